"""Run policies over one workload: each faulted run beside its failure-free reference."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from lumend.sim.config import SimConfig, apply_policy
from lumend.sim.engine import SimResult, simulate
from lumend.sim.metrics import PolicyMetrics, Timeline, impact_window, recovery_of, summarize
from lumend.sim.workload import Workload


@dataclass(frozen=True, slots=True)
class PolicyRun:
    metrics: PolicyMetrics
    timeline: Timeline
    wall_s: float  # both runs (faulted and reference)


def reference_config(cfg: SimConfig) -> SimConfig:
    """The failure-free run of `cfg`, with what only recovery uses normalised, so policies
    that differ only in recovery (routing, assist, shadows) share one reference run."""
    ref = cfg.without_fault()
    return replace(ref, shadows=False,
                   policy=replace(ref.policy, adaptive_routing=False, draft_assist=False))


def _simulate_pair(workload: Workload, cfg: SimConfig, name: str,
                   references: dict[SimConfig, SimResult] | None
                   ) -> tuple[SimResult, SimResult, float]:
    started = time.perf_counter()
    policy_cfg = apply_policy(cfg, name)
    faulted = simulate(workload, policy_cfg)
    key = reference_config(policy_cfg)
    reference = references.get(key) if references is not None else None
    if reference is None:
        reference = simulate(workload, key)
        if references is not None:
            references[key] = reference
    return faulted, reference, time.perf_counter() - started


def run_policy(workload: Workload, cfg: SimConfig, name: str,
               references: dict[SimConfig, SimResult] | None = None) -> PolicyRun:
    """The faulted run of policy `name` beside its failure-free reference (taken from and
    added to `references` when given); the impact window is `cfg.window_s` or, when None,
    until this run has recovered."""
    faulted, reference, wall = _simulate_pair(workload, cfg, name, references)
    metrics, timeline = summarize(name, faulted, reference, cfg.window_s, cfg.bin_s)
    return PolicyRun(metrics, timeline, wall)


def run_policies(
    workload: Workload, cfg: SimConfig, names: Sequence[str],
    on_done: Callable[[str], None] | None = None,
) -> list[PolicyRun]:
    """Every policy on `workload`; their metrics over one impact window: `cfg.window_s`, or
    until the slowest of them has recovered. `on_done(name)` after each simulation."""
    pairs = []
    references: dict[SimConfig, SimResult] = {}
    for name in names:
        pairs.append((name, *_simulate_pair(workload, cfg, name, references)))
        if on_done is not None:
            on_done(name)
    window = cfg.window_s
    if window is None and pairs:
        window = impact_window([recovery_of(f, cfg.bin_s) for _, f, _, _ in pairs],
                               pairs[0][1], cfg.bin_s)
    runs = []
    for name, faulted, reference, wall in pairs:
        metrics, timeline = summarize(name, faulted, reference, window, cfg.bin_s)
        runs.append(PolicyRun(metrics, timeline, wall))
    return runs


def metrics_document(m: PolicyMetrics) -> dict[str, Any]:
    """JSON-ready: NaN (no requests in the set) becomes null."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in asdict(m).items()}
