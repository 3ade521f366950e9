"""The cuda backend's CPU-checkable parts: size rounding, handle and mapping bookkeeping,
and the errors a machine without cuda-python or without a driver gets. (Real GPU memory:
bench/gpu/gms_check.py.)"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lumend.gms.backend import round_up
from lumend.gms.client import GmsError
from lumend.gms.cuda_vmm import HandleTable, MapState, next_map_state

from .conftest import GmsProcess

HAS_DRIVER = bool(ctypes.util.find_library("cuda")) or os.path.exists("/dev/nvidiactl")
HAS_CUDA_PYTHON = importlib.util.find_spec("cuda") is not None and (
    importlib.util.find_spec("cuda.bindings") is not None)
no_gpu_here = pytest.mark.skipif(HAS_DRIVER, reason="this machine has an NVIDIA driver")

BLOCK_CUDA = "import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None; "


def test_sizes_round_up_to_the_device_granularity() -> None:
    two_mib = 2 << 20
    assert round_up(1, two_mib) == two_mib
    assert round_up(two_mib, two_mib) == two_mib
    assert round_up(two_mib + 1, two_mib) == 2 * two_mib


def test_handle_table_keeps_one_handle_per_exported_fd() -> None:
    table = HandleTable()
    table.add(7, 0xA, 2 << 20)
    table.add(8, 0xB, 4 << 20)
    assert len(table) == 2 and table.total_bytes == 6 << 20
    with pytest.raises(ValueError, match="fd 7 already names"):
        table.add(7, 0xC, 2 << 20)
    assert table.pop(7) == (0xA, 2 << 20)
    with pytest.raises(ValueError, match="fd 7 is not a GMS allocation"):
        table.pop(7)
    assert len(table) == 1 and table.total_bytes == 4 << 20


def test_mapping_states_allow_only_unmap_remap_close() -> None:
    assert next_map_state(MapState.MAPPED, "unmap") is MapState.UNMAPPED
    assert next_map_state(MapState.UNMAPPED, "remap") is MapState.MAPPED
    assert next_map_state(MapState.UNMAPPED, "close") is MapState.CLOSED
    assert next_map_state(MapState.MAPPED, "close") is MapState.CLOSED
    for state, action in [(MapState.MAPPED, "remap"), (MapState.UNMAPPED, "unmap"),
                          (MapState.CLOSED, "remap"), (MapState.CLOSED, "unmap")]:
        with pytest.raises(RuntimeError, match=f"cannot {action} while {state.value}"):
            next_map_state(state, action)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


def test_without_cuda_python_the_error_says_install_lumen_gpu() -> None:
    out = _run(BLOCK_CUDA + "from lumend.gms.cuda_vmm import driver\n"
               "try:\n    driver()\nexcept Exception as e:\n"
               "    print(type(e).__name__, e)")
    assert out.stdout.startswith("CudaPythonMissing"), out.stderr  # a CudaUnavailable
    assert "install LUMEN's gpu extra" in out.stdout and "backend 'host'" in out.stdout
    # The fix is the role's extras or the wheel built from the checkout, never a name lookup.
    assert "lumend_extras" in out.stdout and "py3-none-any.whl[gpu]'" in out.stdout
    assert "lumen-serving" not in out.stdout


def test_gms_server_with_cuda_backend_exits_2_naming_the_fix(tmp_path: Path) -> None:
    sock = str(tmp_path / "gms.sock")
    out = _run(BLOCK_CUDA + "from lumend.gms.server import main; "
               f"sys.argv = ['gms', '--socket', {sock!r}, '--backend', 'cuda']; main()")
    assert out.returncode == 2 and "install LUMEN's gpu extra" in out.stderr
    assert not os.path.exists(sock)


@no_gpu_here
def test_gms_server_on_a_machine_without_a_driver_says_so(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "lumend.gms.server", "--socket",
                          str(tmp_path / "gms.sock"), "--backend", "cuda"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    # Which fix applies depends on what this machine lacks first.
    expected = "no CUDA driver" if HAS_CUDA_PYTHON else "install LUMEN's gpu extra"
    assert expected in out.stderr, out.stderr


def test_device_and_host_mappings_are_not_confused(gms: GmsProcess) -> None:
    with gms.client() as writer:
        assert writer.hello("writer") == "writer" and writer.backend == "host"
        alloc, _ = writer.allocate("weights", 4096)
        with pytest.raises(GmsError, match=r"host memory .*map\(\), not map_device"):
            writer.map_device(alloc, device=None)  # type: ignore[arg-type]


@no_gpu_here
def test_the_gpu_check_script_exits_2_without_cuda() -> None:
    script = Path(__file__).parents[2] / "bench" / "gpu" / "gms_check.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "no usable CUDA here, nothing checked" in out.stderr
    assert out.stdout == ""  # no table: nothing was checked


@pytest.mark.parametrize("driver_py", [
    "from ._missing_extension import cuInit\n",  # a wheel built for another Python
    "raise AttributeError('module has no attribute CUresult')\n",  # a half-upgraded install
    "class CUresult:\n    CUDA_SUCCESS = 0\n"
    "def cuInit(flags):\n    raise TypeError('bad argument')\n",  # loads, then fails
])
def test_a_broken_cuda_python_is_named_with_the_reinstall_fix(tmp_path: Path,
                                                               driver_py: str) -> None:
    package = tmp_path / "cuda" / "bindings"
    package.mkdir(parents=True)
    (tmp_path / "cuda" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "driver.py").write_text(driver_py)
    out = _run(f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
               "from lumend.gms.cuda_vmm import driver\n"
               "try:\n    driver()\nexcept Exception as e:\n"
               "    print(type(e).__name__, e)")
    assert out.stdout.startswith("CudaUnavailable cuda-python is installed but does not work"), (
        out.stdout + out.stderr)
    assert "pip install --force-reinstall 'cuda-python>=12.6,<13'" in out.stdout
