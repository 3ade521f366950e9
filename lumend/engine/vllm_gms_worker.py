"""vLLM on GPU with its weights in GMS: a `--worker-cls` Worker subclass.

    python -m vllm.entrypoints.openai.api_server --model M --enable-sleep-mode \
        --worker-cls lumend.engine.vllm_gms_worker.LumenGmsWorker
    (environment: VLLM_SERVER_DEV_MODE=1 LUMEN_GMS_SOCKET=/run/lumen/w0/gms.sock)

`gpu_engine_args(socket)` gives exactly those arguments and variables.

Loading: the worker joins GMS (cuda backend) as `auto`. The first engine becomes the
writer: it loads the checkpoint as vLLM normally does, copies every tensor into GMS (chunk
by chunk, re-pointing the model at the shared copy so its private copy is freed) and
commits. Every later engine (a shadow, a restarted engine) is a reader: it builds the model
on the meta device and attaches the committed tensors, mapped read-only: no disk read, no
copy. The loader tells vLLM that these bytes are held outside the engine, so its memory
budget and KV sizing leave them out.

Sleep and wake: weights are not in vLLM's CuMem pool, so sleep never copies them to host
memory (at any level); the worker unmaps them, keeping their address ranges reserved, and
leaves the GMS session. Wake re-joins as a reader, checks that the committed layout is the
one it mapped (same hash) and maps the same allocations at the same addresses, so CUDA
graphs captured against them stay valid. The KV cache and the rest go through vLLM's own
sleep backend as usual.

Limits: one GMS server per GPU (with tensor parallelism, put `{rank}` or `{device}` in
LUMEN_GMS_SOCKET); speculative decoding's draft model is not shared; weights in GMS are
read-only, so in-place weight updates are refused. Pass `--kv-cache-memory-bytes` when
several engines of one worker start together: vLLM's memory profiling assumes no other
process changes the GPU's free memory meanwhile.

Importing this module does not import vLLM: the class is built when vLLM asks for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

WORKER_CLS = "lumend.engine.vllm_gms_worker.LumenGmsWorker"
LOAD_FORMAT = "lumen_gms"
GMS_SOCKET_ENV = "LUMEN_GMS_SOCKET"
GMS_TIMEOUT_ENV = "LUMEN_GMS_TIMEOUT_S"  # how long to wait for a writer or a restarted GMS
DEFAULT_TIMEOUT_S = 600.0

log = logging.getLogger("lumend.engine.vllm_gms")


def gpu_engine_args(gms_socket: str) -> tuple[list[str], dict[str, str]]:
    """vLLM arguments and environment for a GPU engine whose weights live in GMS."""
    return (["--enable-sleep-mode", "--worker-cls", WORKER_CLS],
            {"VLLM_SERVER_DEV_MODE": "1", GMS_SOCKET_ENV: gms_socket})


def socket_for(template: str, rank: int, device: int) -> str:
    """The GMS socket of one worker process: `{rank}`/`{device}` in the template are
    replaced (tensor parallelism needs one GMS server per GPU)."""
    return template.replace("{rank}", str(rank)).replace("{device}", str(device))


def committed_weight_bytes(socket_path: str, timeout_s: float) -> int:
    """Bytes of weights already committed in GMS (0 when this engine will be the writer).

    While another engine is still writing, wait for its commit: this engine will map
    those weights, and vLLM must leave them out of its memory budget.
    """
    from lumend.gms.client import GmsClient, GmsError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with GmsClient(socket_path) as client:
                stats = client.stats()
        except GmsError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        state = stats["state"]
        if state in ("committed", "ro"):
            return int(stats["bytes"])
        if state == "empty" or time.monotonic() > deadline:
            return 0
        time.sleep(0.2)


@dataclass
class GmsWeights:
    """This worker process's GMS session and the weight mappings it holds."""

    socket: str
    timeout_s: float
    original_format: str
    client: Any = None
    device: Any = None  # CudaDevice
    layout_hash: str | None = None
    mappings: list[Any] = field(default_factory=list)  # DeviceMapping, in allocation order
    role: str | None = None
    mapped: bool = False

    def connect(self, role: str) -> str:
        from lumend.gms.client import GmsClient, GmsError

        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                client = GmsClient(self.socket)
                break
            except GmsError:  # GMS may be restarting: the supervisor replaces a dead one
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        try:
            granted = client.hello(role, timeout_s=max(1.0, deadline - time.monotonic()))
        except BaseException:
            client.close()
            raise
        if client.backend != "cuda":
            client.close()
            raise RuntimeError(
                f"GMS at {self.socket} runs the {client.backend} backend; vLLM on GPU needs "
                "`lumend gms-server --backend cuda --device N`")
        self.client = client
        self.role = granted
        return granted

    def base_for(self, allocation: int) -> Any:
        from lumend.gms.weights import device_base

        mapping = self.client.map_device(allocation, self.device)
        self.mappings.append(mapping)
        self.mapped = True
        return device_base(mapping)

    def unmap(self) -> None:
        """Sleep: drop the weights from this process, keep their addresses reserved."""
        for mapping in self.mappings:
            mapping.unmap()
        self.mapped = False
        if self.client is not None:
            self.client.close()  # leave the session: GMS keeps the weights for others
            self.client = None

    def remap(self) -> None:
        """Wake: the same allocations at the same addresses, after checking the layout."""
        from lumend.gms.client import LayoutMismatch

        self.connect("reader")
        _, _, committed = self.client.layout()
        if committed != self.layout_hash:
            raise LayoutMismatch(
                f"the GMS weights at {self.socket} changed while this engine slept (layout "
                f"{str(self.layout_hash)[:12]}, now {str(committed)[:12]}): restart this "
                "engine to load the new layout")
        for mapping in self.mappings:
            self.client.remap_device(mapping)
        self.mapped = True


_weights: GmsWeights | None = None


def _state() -> GmsWeights:
    if _weights is None:
        raise RuntimeError(f"the {LOAD_FORMAT} loader runs only inside {WORKER_CLS}")
    return _weights


def __getattr__(name: str) -> Any:
    if name == "LumenGmsWorker":
        cls = _build_worker_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_worker_class() -> type:
    """Import vLLM, register the GMS loader and build the Worker subclass."""
    from contextlib import nullcontext

    import torch
    import vllm.distributed.parallel_state as parallel_state
    import vllm.v1.worker.gpu_worker as gpu_worker

    _register_loader()

    class LumenGmsWorker(gpu_worker.Worker):
        """vLLM's GPU worker with weights from GMS and sleep/wake that keep them there."""

        def init_device(self) -> None:
            global _weights
            template = os.environ.get(GMS_SOCKET_ENV)
            if not template:
                raise RuntimeError(f"{WORKER_CLS} needs {GMS_SOCKET_ENV} (the GMS socket); "
                                   "lumend sets it, see gpu_engine_args()")
            if self.vllm_config.speculative_config is not None:
                raise ValueError(f"{WORKER_CLS} does not share draft models through GMS; "
                                 "run without --speculative-config")
            load_config = self.vllm_config.load_config
            _weights = GmsWeights(
                socket=socket_for(template, self.rank, self.local_rank),
                timeout_s=float(os.environ.get(GMS_TIMEOUT_ENV, DEFAULT_TIMEOUT_S)),
                original_format=str(load_config.load_format))
            # Before the parent's memory snapshot: it asks the loader for external bytes.
            load_config.load_format = LOAD_FORMAT
            super().init_device()

        def _maybe_get_memory_pool_context(self, tag: str) -> Any:
            if tag == "weights":  # GMS holds them; CuMem must never offload or free them
                return nullcontext()
            return super()._maybe_get_memory_pool_context(tag)

        def sleep(self, level: int = 1) -> None:
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
            if _state().mapped:  # a second sleep (e.g. level 1, then 2) has nothing to unmap
                _state().unmap()
            # Nothing tagged "weights" is in the CuMem pool, so level 1 copies nothing to
            # host memory; the KV cache is dropped and runtime state kept, as usual.
            self.sleep_mode_backend.suspend(level)
            if self.vllm_config.model_config.enable_nccl_comm_suspend:
                parallel_state.suspend_device_comms()
            torch.cuda.synchronize()
            free_after = torch.cuda.mem_get_info()[0]
            log.info("asleep (level %d): this engine freed %.2f GiB; GMS keeps the weights",
                     level, (free_after - free_before) / (1 << 30))

        def wake_up(self, tags: list[str] | None = None) -> None:
            state = _state()
            if (tags is None or "weights" in tags) and not state.mapped:
                started = time.monotonic()
                state.remap()
                log.info("weights re-mapped from GMS in %.3f s", time.monotonic() - started)
            self.sleep_mode_backend.resume(tags)
            if self.vllm_config.model_config.enable_nccl_comm_suspend:
                parallel_state.resume_device_comms()
            torch.cuda.synchronize()

        def reload_weights(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("weights in GMS are shared and read-only: restart the "
                               "worker's engines (and its GMS server) to change them")

        def update_weights(self, *args: Any, **kwargs: Any) -> None:
            self.reload_weights()

    LumenGmsWorker.__module__ = __name__
    LumenGmsWorker.__qualname__ = "LumenGmsWorker"
    return LumenGmsWorker


def _register_loader() -> None:
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class LumenGmsLoader(BaseModelLoader):
        """Weights from GMS (reader) or from the checkpoint, then into GMS (writer)."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.disk = DefaultModelLoader(dataclasses.replace(
                load_config, load_format=_state().original_format))

        def get_external_weight_memory(self, vllm_config: Any) -> int:
            state = _state()
            return committed_weight_bytes(state.socket, state.timeout_s)

        def download_model(self, model_config: Any) -> None:
            self.disk.download_model(model_config)

        def load_weights(self, model: Any, model_config: Any) -> None:
            raise RuntimeError("weights in GMS are shared and read-only: they cannot be "
                               "reloaded in place")

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            return _load_model(self.disk, vllm_config, model_config, prefix)

    register_model_loader(LOAD_FORMAT)(LumenGmsLoader)


def _load_model(disk: Any, vllm_config: Any, model_config: Any, prefix: str) -> Any:
    import torch

    from lumend.gms.cuda_vmm import CudaDevice
    from lumend.gms.weights import publish

    state = _state()
    state.device = CudaDevice(torch.cuda.current_device())
    role = state.connect("auto")
    started = time.monotonic()
    try:
        if role == "writer":
            model = disk.load_model(vllm_config=vllm_config, model_config=model_config,
                                    prefix=prefix)
            nbytes = publish(state.client, model, state.base_for,
                             after_chunk=torch.cuda.empty_cache)
            torch.cuda.synchronize()
            state.layout_hash = state.client.commit()
            log.info("loaded the checkpoint and published %.2f GiB into GMS in %.1f s",
                     nbytes / (1 << 30), time.monotonic() - started)
        else:
            model = _map_model(state, vllm_config, model_config, prefix)
            log.info("mapped the weights from GMS in %.2f s (no checkpoint read)",
                     time.monotonic() - started)
    except BaseException:
        for mapping in state.mappings:
            mapping.close()
        state.mappings.clear()
        state.client.close()  # a writer that leaves before commit aborts its layout
        state.client = None
        raise
    return model.eval()


def _map_model(state: GmsWeights, vllm_config: Any, model_config: Any, prefix: str) -> Any:
    import torch
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )
    from vllm.utils.torch_utils import set_default_torch_dtype

    from lumend.gms.weights import WeightsMismatch, materialize, missing_tensors

    _, tensors, committed = state.client.layout()  # verifies the committed hash
    state.layout_hash = committed
    target = torch.device("cuda", torch.cuda.current_device())
    with set_default_torch_dtype(model_config.dtype):
        with torch.device("meta"):
            model = initialize_model(vllm_config=vllm_config, model_config=model_config,
                                     prefix=prefix)
        materialize(model, tensors, state.base_for, require_complete=False)
        try:
            from vllm.model_executor.utils import weights_already_processed
        except ImportError:  # older vLLM: unquantized models need no post-processing
            pass
        else:
            # The writer published post-processed tensors: rebuild only Python-side state.
            with weights_already_processed():
                process_weights_after_loading(model, model_config, target)
    missing = missing_tensors(model)
    if missing:
        raise WeightsMismatch(f"the GMS layout lacks {len(missing)} tensor(s) this model "
                              f"needs (e.g. {', '.join(missing[:5])}): the engines of one "
                              "worker must serve the same model, dtype and parallel layout")
    return model
