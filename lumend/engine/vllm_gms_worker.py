"""vLLM with its weights in GMS: the `--worker-cls` Worker subclasses and their arguments.

    python -m vllm.entrypoints.openai.api_server --model M --enable-sleep-mode \
        --worker-cls lumend.engine.vllm_gms_worker.LumenGmsWorker
    (environment: VLLM_SERVER_DEV_MODE=1 LUMEN_GMS_SOCKET=/run/lumen/w0/gms.sock)

`gms_engine_args(platform, socket)` gives exactly those arguments and variables, for a GPU
engine (`cuda`: this module's LumenGmsWorker over the GMS cuda backend) or its CPU twin
(`cpu`: `vllm_gms_cpu_worker.LumenGmsCpuWorker` over the host backend, memfd pages).

Loading, sharing and sleep/wake are one code path for both (`gms_loader`): the first engine
of a worker loads the checkpoint and publishes it, every later one maps it read-only and
post-processes on the meta device first, so nothing is ever written into shared weights.
Sleep unmaps the weights (their address ranges stay reserved) and then runs vLLM's own
sleep (KV cache, the KV connector's unregister in 0.33); wake maps them back at the same
addresses, so CUDA graphs captured against them stay valid, then runs vLLM's own wake.

GPU notes: weights are not in vLLM's CuMem pool, so sleep never copies them to host
memory; the loader tells vLLM that the mapped bytes are held outside the engine, so its
memory budget and KV sizing leave them out. Limits: one GMS server per GPU (with tensor
parallelism, put `{rank}` or `{device}` in LUMEN_GMS_SOCKET); speculative methods that load
draft weights are refused (weightless proposers such as LUMEN's custom_class work); weights
are read-only, so in-place weight updates are refused. Pass `--kv-cache-memory-bytes` when
several engines of one worker start together: vLLM's memory profiling assumes no other
process changes the GPU's free memory meanwhile.

Importing this module does not import vLLM: the class is built when vLLM asks for it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Literal

from lumend.engine.gms_loader import (
    GMS_SOCKET_ENV,
    GMS_TIMEOUT_ENV,
    LOAD_FORMAT,
    GmsWeights,
    Platform,
    committed_weight_bytes,
    socket_for,
)
from lumend.engine.vllm_gms_cpu_worker import CPU_WORKER_CLS

WORKER_CLS = "lumend.engine.vllm_gms_worker.LumenGmsWorker"

__all__ = ["CPU_WORKER_CLS", "GMS_SOCKET_ENV", "GMS_TIMEOUT_ENV", "LOAD_FORMAT", "WORKER_CLS",
           "GmsWeights", "committed_weight_bytes", "gms_engine_args", "gpu_engine_args",
           "socket_for"]


def gms_engine_args(platform: Literal["cuda", "cpu"],
                    gms_socket: str) -> tuple[list[str], dict[str, str]]:
    """vLLM arguments and environment for an engine whose weights live in GMS.

    cuda: sleep mode on (a shadow sleeps with its weights unmapped, its KV cache freed)
    and the dev endpoints (/sleep, /wake_up) the gate drives. cpu: vLLM has no sleep mode
    on CPU; the twin's shadow stays awake and costs only its KV cache (weights shared).
    """
    if platform == "cuda":
        return (["--enable-sleep-mode", "--worker-cls", WORKER_CLS],
                {"VLLM_SERVER_DEV_MODE": "1", GMS_SOCKET_ENV: gms_socket})
    if platform == "cpu":
        return (["--worker-cls", CPU_WORKER_CLS], {GMS_SOCKET_ENV: gms_socket})
    raise ValueError(f"unknown platform {platform!r} for GMS engines: 'cuda' or 'cpu'")


def gpu_engine_args(gms_socket: str) -> tuple[list[str], dict[str, str]]:
    """vLLM arguments and environment for a GPU engine whose weights live in GMS."""
    return gms_engine_args("cuda", gms_socket)


def cuda_platform() -> Platform:
    import torch

    from lumend.gms.cuda_vmm import CudaDevice
    from lumend.gms.weights import device_base

    ordinal = torch.cuda.current_device()
    device = CudaDevice(ordinal)
    return Platform(
        name="cuda", backend="cuda", device=torch.device("cuda", ordinal),
        map=lambda client, allocation: client.map_device(allocation, device),
        base=device_base, synchronize=torch.cuda.synchronize,
        release_cached=torch.cuda.empty_cache, processing=nullcontext)


def __getattr__(name: str) -> Any:
    if name == "LumenGmsWorker":
        cls = _build_worker_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_worker_class() -> type:
    """Import vLLM and build the GPU Worker subclass."""
    import vllm.v1.worker.gpu_worker as gpu_worker

    from lumend.engine import gms_loader

    gms_loader.register_loader()  # the load format exists wherever the class does

    class LumenGmsWorker(gpu_worker.Worker):
        """vLLM's GPU worker with weights from GMS and sleep/wake that keep them there."""

        def init_device(self) -> None:
            # Before the parent's memory snapshot: it asks the loader for external bytes.
            gms_loader.prepare(self.vllm_config, self.rank, self.local_rank, WORKER_CLS,
                               cuda_platform)
            super().init_device()

        def _maybe_get_memory_pool_context(self, tag: str) -> Any:
            if tag == "weights":  # GMS holds them; CuMem must never offload or free them
                return nullcontext()
            return super()._maybe_get_memory_pool_context(tag)

        def sleep(self, level: int = 1) -> None:
            gms_loader.sleep_weights()
            # vLLM's own: nothing tagged "weights" is in the CuMem pool, so level 1 copies
            # nothing to host memory; the KV cache goes, the connector unregisters (0.33).
            super().sleep(level)

        def wake_up(self, tags: list[str] | None = None) -> None:
            gms_loader.wake_weights(tags)  # first: vLLM's wake may read the weights
            super().wake_up(tags)

        def reload_weights(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("weights in GMS are shared and read-only: restart the "
                               "worker's engines (and its GMS server) to change them")

        def update_weights(self, *args: Any, **kwargs: Any) -> None:
            self.reload_weights()

    LumenGmsWorker.__module__ = __name__
    LumenGmsWorker.__qualname__ = "LumenGmsWorker"
    return LumenGmsWorker
