"""Plots (matplotlib, the optional `plot` extra): a run's timeline of TTFT by arrival bin and
queue depth around the fault; a sweep's heatmap of LUMEN / best baseline TTFT."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lumend.sim.runner import PolicyRun


def plot_timelines(runs: Sequence[PolicyRun], fault_at: float | None, path: Path,
                   title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_queue) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for i, run in enumerate(runs):
        tl = run.timeline
        xs = [b * tl.bin_s + tl.bin_s / 2 for b in range(len(tl.ttft))]
        ax_ttft.plot(xs, [float("nan") if v is None else v for v in tl.ttft],
                     label=run.metrics.policy)
        if i == 0:
            ax_ttft.plot(xs, [float("nan") if v is None else v for v in tl.reference_ttft],
                         color="grey", linestyle="--", label="failure-free")
        ax_queue.plot(tl.sample_t, tl.waiting, label=run.metrics.policy)
    for ax in (ax_ttft, ax_queue):
        if fault_at is not None:
            ax.axvline(fault_at, color="red", linestyle=":", label="fault")
        ax.grid(alpha=0.3)
    ax_ttft.set_ylabel(f"mean TTFT per {runs[0].timeline.bin_s:g} s bin (s)")
    ax_ttft.set_yscale("log")
    ax_queue.set_ylabel("requests waiting for prefill")
    ax_queue.set_xlabel("time (s)")
    ax_ttft.legend(fontsize=8)
    ax_ttft.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(doc: dict[str, Any], path: Path) -> None:
    """A heatmap of LUMEN / best baseline mean TTFT (paired by seed) per sweep cell: columns
    restore bandwidth x reload time, rows workers x prompt scale x load; each tile says the
    ratio and its 95% half-width, below 1 (blue) LUMEN is faster."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    cells = doc["cells"]
    cols = sorted({(c["restore_gbps"], str(c["reload_s"])) for c in cells},
                  key=lambda k: (-k[0], -1.0 if k[1] == "nvme" else float(k[1])))
    rows = sorted({(c["workers"], c["prompt_scale"], c["load"]) for c in cells})
    grid = [[float("nan")] * len(cols) for _ in rows]
    text = [[""] * len(cols) for _ in rows]
    for c in cells:
        r = rows.index((c["workers"], c["prompt_scale"], c["load"]))
        k = cols.index((c["restore_gbps"], str(c["reload_s"])))
        ratio = c["lumen_vs_best"]["ttft_ratio"]
        if ratio is not None:
            grid[r][k] = ratio["mean"]
            text[r][k] = f"{ratio['mean']:.2f}±{ratio['ci95']:.2f}\n{_short(c['best_baseline'])}"
    finite = [v for row in grid for v in row if v == v]
    # Symmetric about 1 so a colour means the same distance from parity on both sides.
    span = max([0.1, *(abs(v - 1) for v in finite)])
    fig, ax = plt.subplots(figsize=(max(7.0, 3.2 + 1.45 * len(cols)), 1.4 + 0.5 * len(rows)))
    image = ax.imshow(grid, cmap="coolwarm", norm=TwoSlopeNorm(1.0, 1 - span, 1 + span),
                      aspect="auto")
    for r, row in enumerate(text):
        for k, label in enumerate(row):
            ax.text(k, r, label, ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(cols)),
                  [f"restore {bw:g} GB/s\nreload {_reload(rl)}" for bw, rl in cols], fontsize=7)
    ax.set_yticks(range(len(rows)),
                  [f"{w} workers, prompts x{p:g}, load {load:g}" for w, p, load in rows],
                  fontsize=7)
    fig.colorbar(image, ax=ax, label="LUMEN / best baseline, mean TTFT")
    ax.set_title(f"{doc['model']} on {doc['gpu']}: LUMEN / best baseline mean TTFT\n"
                 f"{len(doc['seeds'])} seeds, paired by seed (±95%); blue: LUMEN faster",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _short(policy: str) -> str:
    return {"stop_and_restart": "vs S&R", "fixed_checkpoint": "vs fixed"}.get(policy, policy)


def _reload(value: str) -> str:
    return value if value == "nvme" else f"{float(value):g} s"


MISSING = ("--plot needs matplotlib, the optional 'plot' extra: .venv/bin/pip install "
           "'matplotlib>=3.8' (the wheel's [plot] extra); without --plot the "
           "command runs as is")


def plotting_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
