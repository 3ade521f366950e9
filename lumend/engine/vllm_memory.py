"""Each vLLM engine's GPU memory budget, so that the engines of one worker fit together.

vLLM checks at start that the GPU's free memory covers `gpu_memory_utilization` x total,
minus the weights held outside the engine (GMS); with `--kv-cache-memory-bytes` that check
is the only use of the fraction. Its default (0.9) assumes the engine is alone on the GPU:
a shadow that starts while the active engine is awake would be refused. So lumend asks for
what the engine really needs: the weights it maps from GMS (counted by vLLM as external, so
not twice), its KV cache, and a reserve for activations, the CUDA context and graphs.
"""

from __future__ import annotations

import logging
import shutil
import subprocess

ENGINE_RESERVE_BYTES = 4 * 1024**3  # activations, CUDA context, CUDA graphs of one engine
NVIDIA_SMI_TIMEOUT_S = 10.0

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
