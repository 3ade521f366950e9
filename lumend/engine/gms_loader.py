"""vLLM weights in GMS: the loader and session shared by the GPU worker and its CPU twin.

One code path for both; what differs is a `Platform` (how an allocation is mapped, which
GMS backend it needs, what to do around vLLM's weight post-processing):

- writer (the first engine of a worker): load the checkpoint as vLLM does, publish the
  tensors into GMS chunk by chunk (parameters re-pointed at the shared copy and their
  private originals freed as it goes), commit, then make its own parameter mappings
  read-only like every reader's.
- reader (every later engine): build the model on the meta device, run vLLM's
  `process_weights_after_loading` on it BEFORE anything is attached (its writes, such as
  `_k_scale.fill_(1.0)`, land on meta tensors), then map the parameters from GMS read-only
  and give this process private clones of every other tensor (buffers, tensor attributes).
  No checkpoint read, no copy of the weights.

So no engine ever writes into shared memory once it is committed: parameters are
read-only everywhere (a write faults: MMU fault on a GPU, SIGSEGV on the CPU twin), and
what vLLM writes at run time (scales, buffers restored after sleep) is private.

Sleep unmaps the weights (address ranges stay reserved) and leaves the GMS session; wake
re-joins as a reader, checks that the committed layout is the one it mapped and maps the
same allocations at the same addresses. Importing this module does not import vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

LOAD_FORMAT = "lumen_gms"
GMS_SOCKET_ENV = "LUMEN_GMS_SOCKET"
GMS_TIMEOUT_ENV = "LUMEN_GMS_TIMEOUT_S"  # how long to wait for a writer or a restarted GMS
GMS_CHUNK_ENV = "LUMEN_GMS_CHUNK_BYTES"  # the writer's publishing chunk (its peak overhead)
DEFAULT_TIMEOUT_S = 600.0
SUPPORTED_VLLM = ("0.32", "0.33")  # the releases this loader was read against

# Speculative methods whose proposer has no weights of its own (nothing to share).
WEIGHTLESS_PROPOSERS = frozenset({"custom_class", "ngram", "ngram_gpu", "suffix"})

# A child of vLLM's logger: these lines land in the engine's log with vLLM's format and level.
log = logging.getLogger("vllm.lumen_gms")


class GmsUnavailable(RuntimeError):
    """No GMS server answered on the worker's socket within the timeout."""


def check_vllm_version(version: str, worker_cls: str) -> None:
    major_minor = ".".join(version.split(".")[:2])
    if major_minor not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"{worker_cls} supports vLLM {' and '.join(v + '.x' for v in SUPPORTED_VLLM)}; "
            f"this is vLLM {version}: install a supported vLLM (pip install "
            f"'vllm>=0.32,<0.34') or run the worker without GMS")


def check_speculative(method: str | None, worker_cls: str) -> None:
    """Refuse speculative methods that load draft weights (GMS does not share them)."""
    if method is None or method in WEIGHTLESS_PROPOSERS:
        return
    raise ValueError(
        f"{worker_cls} shares the target model's weights through GMS but not draft "
        f"models: speculative method {method!r} loads draft weights. Use a proposer "
        f"without weights ({', '.join(sorted(WEIGHTLESS_PROPOSERS))}; LUMEN's draft-assist "
        "is custom_class) or run this worker without GMS")


def socket_for(template: str, rank: int, device: int) -> str:
    """The GMS socket of one worker process: `{rank}`/`{device}` in the template are
    replaced (tensor parallelism needs one GMS server per GPU)."""
    return template.replace("{rank}", str(rank)).replace("{device}", str(device))


def unreachable(socket_path: str, timeout_s: float, reason: object,
                backend: str = "host|cuda") -> GmsUnavailable:
    return GmsUnavailable(
        f"no GMS server answered at {socket_path} for {timeout_s:.0f} s ({reason}); lumend "
        f"starts one per worker (by hand: python -m lumend.gms.server --socket "
        f"{socket_path} --backend {backend}); see lumend's log for why it is not running")


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
        except GmsError as exc:
            if time.monotonic() > deadline:
                raise unreachable(socket_path, timeout_s, exc) from exc
            time.sleep(0.2)
            continue
        state = stats["state"]
        if state in ("committed", "ro"):
            return int(stats["bytes"])
        if state == "empty" or time.monotonic() > deadline:
            return 0
        time.sleep(0.2)


class WeightMapping(Protocol):
    """One GMS allocation mapped into this process (cuda_vmm.DeviceMapping on a GPU,
    host_vmm.HostMapping on the CPU twin)."""

    allocation: int
    size: int
    va: int
    writable: bool

    def set_access(self, writable: bool) -> None: ...

    def unmap(self) -> None: ...

    def remap(self, fd: int, writable: bool | None = None) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Platform:
    """Everything that differs between the GPU worker and its CPU twin."""

    name: str  # "cuda" or "cpu"
    backend: str  # the GMS backend it maps: "cuda" or "host"
    device: Any  # torch.device the model computes on
    map: Callable[[Any, int], WeightMapping]  # (GmsClient, allocation) -> mapping
    base: Callable[[Any], Any]  # mapping -> flat uint8 tensor over its bytes
    synchronize: Callable[[], None]
    release_cached: Callable[[], None]  # hand freed memory back (between chunks)
    processing: Callable[[], AbstractContextManager[None]]  # around weight post-processing


@dataclass
class GmsWeights:
    """This worker process's GMS session and the weight mappings it holds."""

    socket: str
    timeout_s: float
    original_format: str
    worker_cls: str
    make_platform: Callable[[], Platform]
    platform: Platform | None = None
    client: Any = None
    layout_hash: str | None = None
    mappings: list[WeightMapping] = field(default_factory=list)  # in allocation order
    role: str | None = None
    mapped: bool = False

    def get_platform(self) -> Platform:
        if self.platform is None:
            self.platform = self.make_platform()
        return self.platform

    def connect(self, role: str) -> str:
        from lumend.gms.client import GmsClient, GmsError

        platform = self.get_platform()
        started = time.monotonic()
        deadline = started + self.timeout_s
        next_warning = started + 10.0
        while True:
            try:
                client = GmsClient(self.socket)
                break
            except GmsError as exc:  # GMS may be restarting: the supervisor replaces it
                now = time.monotonic()
                if now > deadline:
                    raise unreachable(self.socket, self.timeout_s, exc,
                                      platform.backend) from exc
                if now > next_warning:
                    log.warning("waiting for the GMS server at %s (%.0f s so far): %s",
                                self.socket, now - started, exc)
                    next_warning = now + 10.0
                time.sleep(0.1)
        try:
            granted = client.hello(role, timeout_s=max(1.0, deadline - time.monotonic()))
        except BaseException:
            client.close()
            raise
        if client.backend != platform.backend:
            client.close()
            raise RuntimeError(
                f"GMS at {self.socket} runs the {client.backend} backend; {self.worker_cls} "
                f"maps the {platform.backend} backend: start it with `python -m "
                f"lumend.gms.server --socket {self.socket} --backend {platform.backend}`")
        self.client = client
        self.role = granted
        return granted

    def base_for(self, allocation: int) -> Any:
        platform = self.get_platform()
        mapping = platform.map(self.client, allocation)
        self.mappings.append(mapping)
        self.mapped = True
        return platform.base(mapping)

    def seal(self) -> None:
        """After the writer's commit: its mappings become read-only, like every reader's
        (a stray write then faults here too instead of changing every engine's weights).
        A driver that refuses to lower access leaves the writer as it was, and says so."""
        for mapping in self.mappings:
            if not mapping.writable:
                continue
            try:
                mapping.set_access(False)
            except (OSError, RuntimeError) as exc:  # CudaError is a RuntimeError
                log.warning("could not make GMS allocation %d read-only in the writer (%s); "
                            "it stays writable in this engine, read-only in the others",
                            mapping.allocation, exc)

    def unmap(self) -> None:
        """Sleep: drop the weights from this process, keep their addresses reserved."""
        self.get_platform().synchronize()  # nothing in flight may still read them
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
        remapped: list[WeightMapping] = []
        try:
            _, _, committed = self.client.layout()
            if committed != self.layout_hash:
                raise LayoutMismatch(
                    f"the GMS weights at {self.socket} changed while this engine slept "
                    f"(layout {str(self.layout_hash)[:12]}, now {str(committed)[:12]}): "
                    "restart this engine to load the new layout")
            for mapping in self.mappings:
                self.client.remap(mapping)  # readers are granted read-only access
                remapped.append(mapping)
        except BaseException:
            for mapping in remapped:  # all or nothing: a later wake starts from unmapped
                mapping.unmap()
            self.client.close()
            self.client = None
            raise
        self.mapped = True

    def abandon(self) -> None:
        """A failed load: close every mapping and leave (a writer that leaves before its
        commit aborts the layout, so the next engine loads again)."""
        for mapping in self.mappings:
            mapping.close()
        self.mappings.clear()
        self.mapped = False
        if self.client is not None:
            self.client.close()
            self.client = None


_weights: GmsWeights | None = None


def state() -> GmsWeights:
    if _weights is None:
        raise RuntimeError(f"the {LOAD_FORMAT} loader runs only inside a LUMEN GMS worker "
                           "(lumend.engine.vllm_gms_worker)")
    return _weights


def prepare(vllm_config: Any, rank: int, local_rank: int, worker_cls: str,
            make_platform: Callable[[], Platform]) -> None:
    """In the worker's init_device, before vLLM's: check the configuration, set up this
    process's GMS session and route model loading through the GMS loader."""
    global _weights
    import vllm

    check_vllm_version(vllm.__version__, worker_cls)
    template = os.environ.get(GMS_SOCKET_ENV)
    if not template:
        raise RuntimeError(f"{worker_cls} needs {GMS_SOCKET_ENV} (the GMS socket); lumend "
                           "sets it, see lumend.engine.vllm_gms_worker.gms_engine_args()")
    speculative = vllm_config.speculative_config
    check_speculative(None if speculative is None else str(speculative.method), worker_cls)
    if getattr(vllm_config.model_config, "sleep_preserve_parameter_names", None):
        raise ValueError(f"{worker_cls}: --sleep-preserve-parameter-names would copy saved "
                         "parameters back into weights that GMS shares read-only on wake; "
                         "GMS keeps every parameter across sleep already, drop the option")
    register_loader()
    load_config = vllm_config.load_config
    _weights = GmsWeights(
        socket=socket_for(template, rank, local_rank),
        timeout_s=float(os.environ.get(GMS_TIMEOUT_ENV, DEFAULT_TIMEOUT_S)),
        original_format=str(load_config.load_format), worker_cls=worker_cls,
        make_platform=make_platform)
    load_config.load_format = LOAD_FORMAT


def sleep_weights() -> None:
    """Unmap the weights (a second sleep, e.g. level 1 then 2, has nothing to unmap)."""
    weights = state()
    if weights.mapped:
        weights.unmap()


def wake_weights(tags: list[str] | None) -> None:
    weights = state()
    if (tags is None or "weights" in tags) and not weights.mapped:
        started = time.monotonic()
        weights.remap()
        log.info("weights re-mapped from GMS at the same addresses in %.3f s",
                 time.monotonic() - started)


_registered = False


def register_loader() -> None:
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class LumenGmsLoader(BaseModelLoader):
        """Weights from GMS (reader) or from the checkpoint, then into GMS (writer)."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.disk = DefaultModelLoader(dataclasses.replace(
                load_config, load_format=state().original_format))

        def get_external_weight_memory(self, vllm_config: Any) -> int:
            weights = state()
            return committed_weight_bytes(weights.socket, weights.timeout_s)

        def download_model(self, model_config: Any) -> None:
            self.disk.download_model(model_config)

        def load_weights(self, model: Any, model_config: Any) -> None:
            raise RuntimeError("weights in GMS are shared and read-only: they cannot be "
                               "reloaded in place; restart the worker's engines (and its "
                               "GMS server) to change them")

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            return load_model(self.disk, vllm_config, model_config, prefix)

    register_model_loader(LOAD_FORMAT)(LumenGmsLoader)
    _registered = True


def load_model(disk: Any, vllm_config: Any, model_config: Any, prefix: str) -> Any:
    from lumend.gms.weights import CHUNK_BYTES, publish

    weights = state()
    platform = weights.get_platform()
    role = weights.connect("auto")
    started = time.monotonic()
    try:
        if role == "writer":
            with platform.processing():
                model = disk.load_model(vllm_config=vllm_config, model_config=model_config,
                                        prefix=prefix)
            nbytes = publish(weights.client, model, weights.base_for,
                             chunk_bytes=int(os.environ.get(GMS_CHUNK_ENV, CHUNK_BYTES)),
                             after_chunk=platform.release_cached)
            platform.synchronize()
            weights.layout_hash = weights.client.commit()
            weights.seal()
            log.info("loaded the checkpoint and published %.3f GiB into GMS in %.1f s "
                     "(layout %s)", nbytes / (1 << 30), time.monotonic() - started,
                     weights.layout_hash[:12])
        else:
            model = _map_model(weights, platform, vllm_config, model_config, prefix)
            log.info("mapped the weights from GMS in %.2f s, no checkpoint read (layout %s)",
                     time.monotonic() - started, str(weights.layout_hash)[:12])
    except BaseException:
        weights.abandon()
        raise
    return model.eval()


def _map_model(weights: GmsWeights, platform: Platform, vllm_config: Any, model_config: Any,
               prefix: str) -> Any:
    import torch
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )
    from vllm.model_executor.utils import weights_already_processed
    from vllm.utils.torch_utils import set_default_torch_dtype

    from lumend.gms.weights import materialize

    _, tensors, committed = weights.client.layout()  # verifies the committed hash
    weights.layout_hash = committed
    with set_default_torch_dtype(model_config.dtype):
        with torch.device("meta"):
            model = initialize_model(vllm_config=vllm_config, model_config=model_config,
                                     prefix=prefix)
        # Before attaching: the writer published post-processed tensors, so this only
        # rebuilds Python-side state, and whatever it writes lands on meta tensors.
        # Re-tying embeddings compares tensor values (impossible on meta); the writer has
        # decided already, and tied names share one GMS tensor that materialize re-ties.
        untied = getattr(model_config, "word_embeddings_untied_by_checkpoint", False)
        if untied:
            model_config.word_embeddings_untied_by_checkpoint = False
        try:
            with platform.processing(), weights_already_processed():
                process_weights_after_loading(model, model_config, platform.device)
        except RuntimeError as exc:
            if "pre-processed" not in str(exc):
                raise
            raise RuntimeError(
                f"{exc}: a GMS reader rebuilds post-processed weights on the meta device, "
                "which this quantization method cannot do; run this worker's engines "
                "without the GMS worker (each then loads its own copy)") from exc
        finally:
            if untied:
                model_config.word_embeddings_untied_by_checkpoint = untied
        materialize(model, tensors, weights.base_for)
    return model
