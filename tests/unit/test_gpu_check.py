"""bench/gpu/device_check.py on a machine without a GPU: it says so (exit 2, valid JSON,
every step skipped with the reason) and its step isolation holds: a step that crashes
(SIGSEGV, as a driver fault ends a process) or hangs is reported as such, and the steps
after it still run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "device_check.py"
REAL_STEPS = {"a_context", "b_read_only", "c_remap_graph", "d_accounting", "e_release",
              "f_publish_peak", "g_page_copy"}


def test_without_cuda_every_step_is_skipped_and_crashes_are_contained(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: run the check itself")
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(CHECK), "--self-test", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["exit_code"] == 2 and result["machine"]["cuda"] is False
    steps = result["steps"]
    assert set(steps) >= REAL_STEPS
    for name in REAL_STEPS:
        assert steps[name]["status"] == "skipped", name
        assert steps[name]["reason"].startswith("no CUDA: ")
    # Run in this order: ok, crash, hang. The crash did not stop the hang from running,
    # and the hang was cut at its own timeout.
    assert steps["self_test_ok"]["status"] == "passed"
    assert steps["self_test_crash"]["status"] == "crashed"
    assert steps["self_test_crash"]["returncode"] == -11
    assert steps["self_test_hang"]["status"] == "timed_out"
    assert result["summary"] == {"passed": 1, "crashed": 1, "timed_out": 1, "skipped": 7}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_the_page_copy_step_s_measurement_runs_on_cpu(dtype: str) -> None:
    """Step g's code (old and new page copies) restores the saved bytes on any device, and
    the connector's batched pages are byte for byte the old per-block ones."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(CHECK.parent))
    from page_copy import TINY, measure  # type: ignore[import-not-found, unused-ignore]

    result = measure({**TINY, "dtype": dtype}, torch.device("cpu"), blocks=8, repeats=1)
    assert result["pages_identical_old_new"]
    assert result["restored_exactly"] == {"old_load": True, "new_load": True}
