"""Each vLLM engine's GPU memory budget, so that the engines of one worker fit together.

vLLM checks at start that the GPU's free memory covers `gpu_memory_utilization` x total,
minus the weights held outside the engine (GMS); with `--kv-cache-memory-bytes` that check
is the only use of the fraction. Its default (0.9) assumes the engine is alone on the GPU:
a shadow that starts while the active engine is awake would be refused. So lumend asks for
what the engine really needs: the weights it maps from GMS (counted by vLLM as external, so
not twice), its KV cache, and a reserve for activations, the CUDA context and graphs.

A worker with shadows whose operator set no split gets one chosen here
(`default_kv_cache_bytes`), from what lumend reads without touching CUDA: nvidia-smi's
total of its GPUs and the size of the model's weight files.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

ENGINE_RESERVE_BYTES = 4 * 1024**3  # activations, CUDA context, CUDA graphs of one engine
NVIDIA_SMI_TIMEOUT_S = 10.0
# Of each GPU, what a worker's engines may hold together when lumend chooses their KV
# caches: vLLM's own default --gpu-memory-utilization, so that the rest is left for what
# neither counts (other processes, fragmentation, NCCL buffers) as vLLM would leave it.
KV_HEADROOM = 0.9
# Below this a chosen KV cache is not worth starting: a few thousand tokens of a large model.
MIN_KV_CACHE_BYTES = 1024**3
WEIGHT_FILES = (".safetensors", ".bin", ".pt")

log = logging.getLogger("lumend.failover")


def memory_utilization(total_bytes: int, external_weight_bytes: int, kv_cache_bytes: int,
                       reserve_bytes: int = ENGINE_RESERVE_BYTES) -> float:
    """vLLM's `--gpu-memory-utilization` for an engine that maps `external_weight_bytes`
    from GMS (0: it loads its own, or writes GMS) and keeps `kv_cache_bytes` of KV cache.
    Rounded up, so that vLLM's rounding never leaves it short."""
    if total_bytes <= 0:
        raise ValueError(f"a GPU of {total_bytes} bytes")
    need = external_weight_bytes + kv_cache_bytes + reserve_bytes
    if need >= total_bytes:
        raise ValueError(
            f"the engine needs {need / 2**30:.1f} GiB (weights mapped from GMS "
            f"{external_weight_bytes / 2**30:.1f}, KV cache {kv_cache_bytes / 2**30:.1f}, "
            f"reserve {reserve_bytes / 2**30:.1f}) of a {total_bytes / 2**30:.1f} GiB GPU: "
            "lower the worker's kv_cache_bytes")
    return min(0.99, -(-need * 10_000 // total_bytes) / 10_000)


def gpu_total_bytes(gpus: list[int]) -> int | None:
    """The smallest total memory of these GPUs (nvidia-smi numbering), from nvidia-smi so
    that lumend itself never initialises CUDA; None when it cannot tell."""
    smi = shutil.which("nvidia-smi")
    if smi is None or not gpus:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits",
             "-i", ",".join(str(g) for g in gpus)],
            capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True)
        return min(int(line.strip()) for line in out.stdout.splitlines() if line.strip()) << 20
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("nvidia-smi could not report the memory of GPUs %s (%s): vLLM engines "
                    "start with their own --gpu-memory-utilization", gpus, exc)
        return None


def default_kv_cache_bytes(total_bytes: int, weight_bytes: int, gpus: int, shadows: int, *,
                           weights_shared: bool | None = None,
                           headroom: float = KV_HEADROOM,
                           reserve_bytes: int = ENGINE_RESERVE_BYTES) -> int:
    """Each engine's KV cache (bytes per GPU, whole MiB) for a worker whose operator set no
    memory split: the largest with which the engines that hold memory at once fit into
    `headroom` of the smallest GPU (`total_bytes`, from nvidia-smi). lumend starts engines
    one at a time, but a shadow initialises next to the awake active engine, so with
    shadows two engines hold KV caches at once (a sleeping shadow holds none):

      weights shared (one GPU, GMS):   weights + 2 x (kv + reserve)      <= headroom x total
      each engine its own (n GPUs):    2 x (weights / n + kv + reserve)  <= headroom x total

    `weights_shared` defaults to what the supervisor does: GMS for a single GPU only.
    Raises ValueError naming the problem and the fix when under MIN_KV_CACHE_BYTES fits."""
    if total_bytes <= 0 or gpus <= 0 or weight_bytes < 0 or shadows < 0:
        raise ValueError(f"no memory split for {gpus} GPUs of {total_bytes} bytes, "
                         f"{weight_bytes} bytes of weights and {shadows} shadows")
    shared = gpus == 1 if weights_shared is None else weights_shared
    engines = min(2, 1 + shadows)
    budget = int(headroom * total_bytes)
    if shared:
        kv = (budget - weight_bytes) // engines - reserve_bytes
    else:
        kv = budget // engines - weight_bytes // gpus - reserve_bytes
    if kv < MIN_KV_CACHE_BYTES:
        gib = 1024**3
        held = ("once (GMS)" if shared else
                f"{weight_bytes / gpus / gib:.1f} GiB per GPU in each engine")
        raise ValueError(
            f"the model's weights {weight_bytes / gib:.1f} GiB ({held}) leave no room for "
            f"{engines} engines' KV caches on a {total_bytes / gib:.1f} GiB GPU (at least "
            f"{MIN_KV_CACHE_BYTES / gib:g} GiB each + {reserve_bytes / gib:g} GiB reserve "
            f"within {headroom:g} of it); set shadows = 0 or use more GPUs")
    return kv >> 20 << 20


def describe_kv_choice(kv_cache_bytes: int, total_bytes: int, weight_bytes: int, gpus: int,
                       shadows: int, weights_shared: bool | None = None,
                       headroom: float = KV_HEADROOM) -> str:
    """What default_kv_cache_bytes chose and from what, for the log and check-config."""
    gib = 1024**3
    shared = gpus == 1 if weights_shared is None else weights_shared
    held = ("in GMS" if shared else
            f"over {gpus} GPUs, {weight_bytes / gpus / gib:.1f} per GPU in each engine")
    return (f"{kv_cache_bytes / gib:.1f} GiB per engine (GPU {total_bytes / gib:.1f} GiB, "
            f"weights {weight_bytes / gib:.1f} GiB {held}, {min(2, 1 + shadows)} engines, "
            f"{headroom:g} headroom)")


def looks_like_path(model: str) -> bool:
    """A model given as a local path, not a hub id such as "Qwen/Qwen3-8B" (or a sim preset)."""
    return model.startswith(("/", "./", "../", "~"))


def weights_on_disk(model: str) -> int | None:
    """The size of a local model directory's weight files (their size in GPU memory for an
    unquantised checkpoint loaded in its own dtype); None for a hub id or no such files."""
    local = os.path.expanduser(model)
    if not looks_like_path(model) or not os.path.isdir(local):
        return None
    try:
        sizes = {ext: sum(e.stat().st_size for e in os.scandir(local)
                          if e.is_file() and e.name.endswith(ext)) for ext in WEIGHT_FILES}
    except OSError:
        return None
    # A checkpoint may ship the same weights in two formats: vLLM loads one.
    return next((size for size in sizes.values() if size), None)
