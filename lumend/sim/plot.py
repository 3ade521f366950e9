"""Timeline plot: TTFT by arrival bin and cluster queue depth around the fault."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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
