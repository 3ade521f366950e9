"""Run policies over one workload: each faulted run beside its failure-free reference."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lumend.sim.config import SimConfig, apply_policy
from lumend.sim.engine import simulate
from lumend.sim.metrics import PolicyMetrics, Timeline, summarize
from lumend.sim.workload import Workload


@dataclass(frozen=True, slots=True)
class PolicyRun:
    metrics: PolicyMetrics
    timeline: Timeline
    wall_s: float  # both runs (faulted and reference)


def run_policy(workload: Workload, cfg: SimConfig, name: str) -> PolicyRun:
    started = time.perf_counter()
    policy_cfg = apply_policy(cfg, name)
    faulted = simulate(workload, policy_cfg)
    reference = simulate(workload, policy_cfg.without_fault())
    metrics, timeline = summarize(name, faulted, reference, cfg.window_s, cfg.bin_s)
    return PolicyRun(metrics, timeline, time.perf_counter() - started)


def run_policies(
    workload: Workload, cfg: SimConfig, names: Sequence[str],
    on_done: Callable[[PolicyRun], None] | None = None,
) -> list[PolicyRun]:
    runs = []
    for name in names:
        run = run_policy(workload, cfg, name)
        runs.append(run)
        if on_done is not None:
            on_done(run)
    return runs


def metrics_document(m: PolicyMetrics) -> dict[str, Any]:
    """JSON-ready: NaN (no requests in the set) becomes null."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in asdict(m).items()}
