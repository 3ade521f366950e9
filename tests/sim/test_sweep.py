"""`lumenctl sim --sweep`: the grid, its errors, a tiny sweep end to end, paired ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lumend.sim.config import SimConfig
from lumend.sim.sweep import (
    DEFAULT_AXES,
    SWEEP_POLICIES,
    Cell,
    GridError,
    parse_grid,
    rate_per_worker,
    summarise_cell,
    verdict,
)

TINY = ["--model", "sim-small", "--gpu", "h100-tp4", "--duration", "60", "--fail-at", "20",
        "--loads", "0.6", "--restore-gbps", "25,1", "--reload-s", "nvme", "--prompt-scales",
        "1", "--sizes", "4", "--seeds", "3"]


def lumenctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lumenctl", *args], capture_output=True,
                          text=True, timeout=300, check=False, env=env)


def test_the_default_grid_and_its_axes() -> None:
    grid = parse_grid(*DEFAULT_AXES.values())
    assert len(grid.cells()) == 32
    assert grid.reload_s == (None, 120.0) and grid.sizes == (4, 8)
    assert "32 cells" in grid.describe() and "reload nvme,120 s" in grid.describe()
    one = parse_grid("0.7", "25", "NVME", "2", "4")
    assert one.cells() == [Cell(0.7, 25.0, None, 2.0, 4)]


@pytest.mark.parametrize(("axes", "message"), [
    (("0.5,x", "25", "nvme", "1", "4"), "--loads: 'x' is not a number"),
    (("0.5,,0.7", "25", "nvme", "1", "4"), "--loads: empty value"),
    (("2", "25", "nvme", "1", "4"), "--loads: 2 is not a share of capacity"),
    (("0.5", "0", "nvme", "1", "4"), "--restore-gbps: 0 GB/s must be positive"),
    (("0.5", "25", "nvme,-1", "1", "4"), "--reload-s: -1 s must be >= 0"),
    (("0.5", "25", "nvme,nvme", "1", "4"), "'nvme' is repeated"),
    (("0.5", "25", "fast", "1", "4"), "--reload-s: 'fast' is not a number"),
    (("0.5", "25", "nvme", "0", "4"), "--prompt-scales: 0 must be positive"),
    (("0.5", "25", "nvme", "1", "4.5"), "--sizes: 4.5 is not a whole number"),
    (("0.5", "25", "nvme", "1", "1"), "a failure needs a survivor"),
    (("0.5,0.5", "25", "nvme", "1", "4"), "a value is repeated"),
])
def test_bad_grid_values_name_the_option(axes: tuple[str, ...], message: str) -> None:
    with pytest.raises(GridError, match=message):
        parse_grid(*axes)


def test_the_cli_rejects_bad_grids_and_misplaced_options_with_exit_2() -> None:
    bad = lumenctl("sim", "--sweep", "--loads", "0.5,high")
    assert bad.returncode == 2, bad.stderr
    assert "--loads: 'high' is not a number; give a comma list such as 0.5,0.7" in bad.stderr
    assert "Traceback" not in bad.stderr
    alone = lumenctl("sim", "--sizes", "4,8")
    assert alone.returncode == 2 and "--sizes is a --sweep axis option" in alone.stderr
    clash = lumenctl("sim", "--sweep", "--workers", "4")
    assert clash.returncode == 2 and "--sweep sets --workers itself" in clash.stderr


def test_a_tiny_sweep_has_every_cell_in_its_json_and_draws_a_heatmap(tmp_path: Path) -> None:
    plot = tmp_path / "sweep.png"
    done = lumenctl("-o", "json", "sim", "--sweep", *TINY, "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["seeds"] == [0, 1, 2] and doc["policies"] == list(SWEEP_POLICIES)
    assert [(c["restore_gbps"], c["reload_s"]) for c in doc["cells"]] == [(25.0, "nvme"),
                                                                          (1.0, "nvme")]
    for cell in doc["cells"]:
        assert cell["best_baseline"] in ("stop_and_restart", "fixed_checkpoint")
        assert set(cell["policies"]) == set(SWEEP_POLICIES)
        for p in cell["policies"].values():
            assert p["mean_ttft_s"]["mean"] > 0 and p["mean_ttft_s"]["missing"] == 0
        for name in ("lumen_vs_best", "lumen_shadow_vs_best"):
            ttft = cell[name]["ttft_ratio"]
            assert ttft["pairs"] == 3 and ttft["mean"] > 0
            assert cell[name]["ttft"] in ("better", "same", "worse")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = lumenctl("sim", "--sweep", *TINY[:-2], "--seeds", "2")
    assert table.returncode == 0, table.stderr
    assert "2 cells" in table.stdout and "LUMEN/BEST TTFT" in table.stdout


def test_without_matplotlib_plot_says_how_to_get_it(tmp_path: Path) -> None:
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = {**os.environ, "PYTHONPATH": str(shim.parent)}
    done = lumenctl("sim", "--sweep", *TINY, "--plot", str(tmp_path / "x.png"), env=env)
    assert done.returncode == 2
    assert "--plot needs matplotlib" in done.stderr and "pip install" in done.stderr
    # Negative control: the same shim without --plot runs.
    plain = lumenctl("-o", "json", "sim", "--sweep", *TINY[:-2], "--seeds", "1", env=env)
    assert plain.returncode == 0, plain.stderr


def doc(ttft: float, recovery: float | None) -> dict[str, float | None]:
    return {"mean_ttft_s": ttft, "recovery_time_s": recovery, "baseline_mean_ttft_s": 0.2}


def test_a_cells_ratio_is_paired_by_seed_known_answer() -> None:
    # Seed 2 is a hard seed for everyone. fixed has the lower mean TTFT (2.0 vs 2.4): it is
    # the best baseline. Per seed LUMEN / fixed is 0.5, 1.0, 0.9: mean 0.8, sd 0.2646,
    # t(2) = 4.303 -> half-width 4.303 * 0.2646 / sqrt(3) = 0.657. The ratio of the means
    # would be 1.9 / 2.0 = 0.95: not what a paired comparison reports.
    per_seed = {
        "stop_and_restart": [doc(1.2, 60.0), doc(1.0, 60.0), doc(5.0, 60.0)],
        "fixed_checkpoint": [doc(1.0, 60.0), doc(0.5, 50.0), doc(4.5, 40.0)],
        "lumen": [doc(0.5, 30.0), doc(0.5, 50.0), doc(4.05, None)],
        "lumen_shadow": [doc(0.2, 10.0), doc(0.1, 0.0), doc(0.9, 10.0)],
    }
    cell = summarise_cell(per_seed)
    assert cell["best_baseline"] == "fixed_checkpoint"
    ttft = cell["lumen_vs_best"]["ttft_ratio"]
    assert ttft["mean"] == pytest.approx(0.8) and ttft["pairs"] == 3
    assert ttft["ci95"] == pytest.approx(4.303 * (0.07 ** 0.5) / 3 ** 0.5, rel=1e-3)
    assert cell["lumen_vs_best"]["ttft"] == "same"  # 0.8 ± 0.66 includes 1
    # A seed where LUMEN never recovered drops out of the recovery pairs: 30/60 and 50/50.
    rec = cell["lumen_vs_best"]["recovery_ratio"]
    assert rec["pairs"] == 2 and rec["mean"] == pytest.approx(0.75)
    assert cell["policies"]["lumen"]["recovery_time_s"]["missing"] == 1
    shadow = cell["lumen_shadow_vs_best"]
    assert shadow["ttft_ratio"]["mean"] == pytest.approx((0.2 + 0.2 + 0.2) / 3)
    assert shadow["ttft"] == "better"


def test_verdicts_and_the_capacity_estimate() -> None:
    assert verdict({"mean": 1.2, "ci95": 0.1}) == "worse"
    assert verdict({"mean": 0.8, "ci95": 0.1}) == "better"
    assert verdict({"mean": 1.05, "ci95": 0.1}) == "same"
    assert verdict(None) == "n/a"
    # Load 1 is one worker's estimated capacity: for Qwen3-32B on a100-tp4 the 6.3 req/s
    # where failure-free runs were measured to saturate (docs/simulator.md).
    cfg = SimConfig(model="qwen3-32b", gpu="a100-tp4")
    assert rate_per_worker(cfg, Cell(1.0, 25.0, None, 1.0, 4)) == pytest.approx(6.29, abs=0.01)
    # Longer prompts: fewer requests for the same share.
    assert rate_per_worker(cfg, Cell(1.0, 25.0, None, 4.0, 4)) < 6.29 / 3
