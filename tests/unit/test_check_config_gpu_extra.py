"""`lumend check-config` on a GPU host without cuda-python (the gpu extra), which the GMS
servers of single-GPU vLLM workers need: a warning (an error under --strict) naming the fix.
The NVIDIA device and the import are passed in: a fake device file and a fake import."""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from lumend import __version__, cli
from lumend.cli import app, gpu_extra_warnings
from lumend.config import parse_config
from lumend.gms.cuda_vmm import CUDA_PYTHON_SPEC, GPU_EXTRA_HINT

from .test_config import config_text, worker

ROOT = Path(__file__).parents[2]


def not_installed(name: str) -> Any:
    """cuda-python absent: the top package `cuda` is not there."""
    raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}", name="cuda")


def installed(name: str) -> Any:
    return SimpleNamespace(__name__=name)


def broken(name: str) -> Any:
    raise ImportError("cannot import name 'cuInit' from partially initialized module")


def vllm_node(*workers: dict[str, Any]) -> Any:
    return parse_config(config_text(workers=list(workers)))


@pytest.fixture
def nvidiactl(tmp_path: Path) -> Path:
    device = tmp_path / "nvidiactl"
    device.touch()
    return device


def test_a_gpu_host_without_cuda_python_is_warned_naming_the_fix(nvidiactl: Path) -> None:
    config = vllm_node(worker(engine="vllm", model="Qwen/Qwen3-8B"))
    [warning] = gpu_extra_warnings(config, nvidiactl, not_installed)
    assert "workers 'w0' (vllm, one GPU)" in warning and "lacks cuda-python" in warning
    assert "lumend_extras" in warning and "gpu" in warning
    assert f"'dist/lumen_serving-{__version__}-py3-none-any.whl[gpu]'" in warning
    assert "pip install 'lumen-serving" not in warning  # never a name lookup on an index


def test_negative_controls_no_warning(tmp_path: Path, nvidiactl: Path) -> None:
    config = vllm_node(worker(engine="vllm", model="Qwen/Qwen3-8B"))
    # cuda-python there: nothing to say.
    assert gpu_extra_warnings(config, nvidiactl, installed) == []
    # No NVIDIA driver (a CPU node): the GMS servers run the host backend.
    assert gpu_extra_warnings(config, tmp_path / "no-nvidiactl", not_installed) == []
    # Sim workers and multi-GPU vLLM workers run no cuda GMS server.
    sim = vllm_node(worker(engine="sim"))
    assert gpu_extra_warnings(sim, nvidiactl, not_installed) == []
    wide = vllm_node(worker(engine="vllm", model="Qwen/Qwen3-8B", gpus=[0, 1]))
    assert gpu_extra_warnings(wide, nvidiactl, not_installed) == []


def test_only_older_bindings_count_as_installed(nvidiactl: Path) -> None:
    """cuda-python before 12.6 has cuda.cuda, not cuda.bindings: lumend uses either."""
    def old_layout(name: str) -> Any:
        if name.startswith("cuda.bindings"):
            raise ModuleNotFoundError("No module named 'cuda.bindings'", name="cuda.bindings")
        return SimpleNamespace(__name__=name)

    config = vllm_node(worker(engine="vllm", model="Qwen/Qwen3-8B"))
    assert gpu_extra_warnings(config, nvidiactl, old_layout) == []


def test_a_broken_cuda_python_is_named_with_its_reinstall_fix(nvidiactl: Path) -> None:
    config = vllm_node(worker(engine="vllm", model="Qwen/Qwen3-8B"),
                       worker(name="w1", gpus=[1], engine="vllm", model="Qwen/Qwen3-8B",
                              port=8110))
    [warning] = gpu_extra_warnings(config, nvidiactl, broken)
    assert warning.startswith("workers 'w0', 'w1' (vllm, one GPU)")
    assert "cuda-python is installed but does not work here" in warning
    assert f"pip install --force-reinstall '{CUDA_PYTHON_SPEC}'" in warning


def test_the_pin_in_messages_is_pyprojects_gpu_extra() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["gpu"] == [CUDA_PYTHON_SPEC]
    assert pyproject["project"]["version"] == __version__  # the wheel's name in the hint
    assert "lumen-serving" not in GPU_EXTRA_HINT


def test_check_config_reports_it_and_strict_fails(tmp_path: Path, nvidiactl: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's wiring: the command has no flag for the device or the import, so here
    (only) the check's defaults are replaced by the fakes."""
    path = tmp_path / "lumend.toml"
    path.write_text(config_text(workers=[worker(engine="vllm", model="Qwen/Qwen3-8B")]))
    runner = CliRunner()
    baseline = runner.invoke(app, ["check-config", "--strict", str(path)])
    assert baseline.exit_code == 0, baseline.output  # this machine: nothing to say

    def fake(config: Any) -> list[str]:
        return gpu_extra_warnings(config, nvidiactl, not_installed)

    monkeypatch.setattr(cli, "gpu_extra_warnings", fake)
    loose = runner.invoke(app, ["check-config", str(path)])
    assert loose.exit_code == 0, loose.output
    assert "warning: workers 'w0' (vllm, one GPU): this GPU host lacks cuda-python" in (
        loose.output)
    strict = runner.invoke(app, ["check-config", "--strict", str(path)])
    assert strict.exit_code == 2, strict.output
    assert "error: workers 'w0' (vllm, one GPU)" in strict.output
    assert "1 problems (--strict)" in strict.output
