"""Metrics of a faulted run against its failure-free reference run (same workload, policy).

* Impact window: requests arriving in [fault, fault + window_s], plus every request the
  fault moved off a failed worker. Mean/p99 TTFT and TPOT are over that set; the reference
  run's numbers over the same request ids are reported beside them.
* Recovery time: TTFT is binned by arrival time (bin_s); the system has recovered at the
  first bin, from the one holding the fault on, where this and the next RECOVERY_HOLD_BINS-1
  bins have a mean TTFT within 10% of the reference run's. Recovery time is that bin's
  start minus the fault time (0 if the fault never moved the metric); None if it never
  recovers before the trace ends.
* Replay TTFT: for interrupted requests, fault time until their next token.
* Checkpoint coverage: checkpointed tokens usable at the fault over tokens resident on the
  failed workers (requests with a live holder and a whole block count).
* Holder balance: max / mean checkpoint bytes held over the live workers at the fault.
* Assist acceptance: drafted tokens the assisted survivors accepted over tokens drafted, from
  the draft rounds the run verified (None when no draft round ran: no assist in the policy).
* Detection and return: seconds from the fault until the cluster noticed it and until the
  failed workers served again (shadow takeover or reload).
* Evictions: checkpoint replicas evicted from full holders; refused: placements that found
  no holder with room (and could not evict).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lumend.sim.engine import Req, SimResult

RECOVERY_TOLERANCE = 0.10
RECOVERY_HOLD_BINS = 3


@dataclass(frozen=True, slots=True)
class PolicyMetrics:
    policy: str
    requests: int
    window_requests: int
    mean_ttft_s: float
    p99_ttft_s: float
    mean_tpot_s: float
    p99_tpot_s: float
    baseline_mean_ttft_s: float
    baseline_mean_tpot_s: float
    recovery_time_s: float | None
    interrupted: int
    resumed: int
    replay_ttft_mean_s: float | None
    replay_ttft_p99_s: float | None
    replay_done_s: float | None      # fault until the last interrupted request streams again
    checkpoint_coverage: float | None
    holder_balance: float | None
    assist_acceptance: float | None  # accepted / drafted tokens over the run's draft rounds
    draft_rounds: int
    detected_after_s: float | None
    back_after_s: float | None
    evictions: int
    checkpoints_refused: int
    events: int
    reference_events: int


@dataclass(frozen=True, slots=True)
class Timeline:
    """Per-bin mean TTFT (by arrival) and sampled queue depth, for plots."""

    bin_s: float
    ttft: list[float | None]
    reference_ttft: list[float | None]
    sample_t: list[float]
    waiting: list[int]


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def ttft(r: Req) -> float:
    return r.first_token - r.arrival


def tpot(r: Req) -> float | None:
    return (r.finish - r.first_token) / (r.output - 1) if r.output > 1 else None


def binned_ttft(requests: Sequence[Req], bin_s: float, bins: int) -> list[float | None]:
    sums = [0.0] * bins
    counts = [0] * bins
    for r in requests:
        b = int(r.arrival // bin_s)
        if 0 <= b < bins:
            sums[b] += ttft(r)
            counts[b] += 1
    return [s / c if c else None for s, c in zip(sums, counts, strict=True)]


def recovery_time(
    faulted: list[float | None], reference: list[float | None], fault_at: float, bin_s: float
) -> float | None:
    start = int(fault_at // bin_s)

    def ok(b: int) -> bool:
        f, r = faulted[b], reference[b]
        return f is None or r is None or abs(f - r) <= RECOVERY_TOLERANCE * r

    for b in range(start, len(faulted) - RECOVERY_HOLD_BINS + 1):
        if all(ok(b + j) for j in range(RECOVERY_HOLD_BINS)):
            return max(0.0, b * bin_s - fault_at)
    return None


def summarize(
    policy: str, faulted: SimResult, reference: SimResult, window_s: float, bin_s: float
) -> tuple[PolicyMetrics, Timeline]:
    reqs, ref = faulted.requests, reference.requests
    fault = faulted.fault
    if fault is None:
        lo, hi = -math.inf, math.inf
    else:
        lo, hi = fault.at, fault.at + window_s
    window = [r for r in reqs if lo <= r.arrival <= hi or r.epoch > 0]
    ids = [r.rid for r in window]
    tpots = [t for r in window if (t := tpot(r)) is not None]
    ref_window = [ref[i] for i in ids]
    ref_tpots = [t for r in ref_window if (t := tpot(r)) is not None]
    interrupted = [r for r in reqs if r.interrupted_at >= 0]
    replays = [r.replay_first - r.interrupted_at for r in interrupted]
    on_failed = [r for r in reqs if r.resident_at_fault > 0]
    resident = math.fsum(r.resident_at_fault for r in on_failed)
    covered = sum(r.ckpt_tokens for r in on_failed)
    last_arrival = max((r.arrival for r in reqs), default=0.0)
    bins = int(last_arrival // bin_s) + 1
    f_bins, r_bins = binned_ttft(reqs, bin_s, bins), binned_ttft(ref, bin_s, bins)
    recovery = None if fault is None else recovery_time(f_bins, r_bins, fault.at, bin_s)
    metrics = PolicyMetrics(
        policy=policy,
        requests=len(reqs),
        window_requests=len(window),
        mean_ttft_s=mean([ttft(r) for r in window]),
        p99_ttft_s=percentile([ttft(r) for r in window], 99),
        mean_tpot_s=mean(tpots),
        p99_tpot_s=percentile(tpots, 99),
        baseline_mean_ttft_s=mean([ttft(r) for r in ref_window]),
        baseline_mean_tpot_s=mean(ref_tpots),
        recovery_time_s=recovery,
        interrupted=len(interrupted),
        resumed=sum(1 for r in interrupted if r.resumed),
        replay_ttft_mean_s=mean(replays) if replays else None,
        replay_ttft_p99_s=percentile(replays, 99) if replays else None,
        replay_done_s=max(replays) if replays else None,
        checkpoint_coverage=covered / resident if resident > 0 else None,
        holder_balance=fault.holder_balance if fault else None,
        assist_acceptance=(faulted.draft_accepted / faulted.drafted
                           if faulted.drafted else None),
        draft_rounds=faulted.draft_rounds,
        detected_after_s=(fault.detected_at - fault.at
                          if fault and fault.detected_at is not None else None),
        back_after_s=fault.back_at - fault.at if fault and fault.back_at is not None else None,
        evictions=faulted.evictions,
        checkpoints_refused=faulted.refused,
        events=faulted.events,
        reference_events=reference.events,
    )
    timeline = Timeline(bin_s, f_bins, r_bins, [s.t for s in faulted.samples],
                        [s.waiting for s in faulted.samples])
    return metrics, timeline
