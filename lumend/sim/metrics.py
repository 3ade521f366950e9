"""Metrics of a faulted run against its failure-free reference run (same workload, policy).

* Impact window (the paper's: until metrics are back): requests arriving in
  [fault, fault + window], plus every request the fault moved off a failed worker, where
  the window is the recovery time of the slowest policy compared (the runner passes it; a
  fixed `SimConfig.window_s` overrides it; to the end of the trace if one never recovers).
  Mean/p99 TTFT and TPOT are over that set; the reference run's numbers over the same
  request ids are reported beside them. Mean TPOT is per token: decode seconds over decode
  tokens of the set (p99 TPOT is over requests).
* Uninterrupted TTFT (the paper's Table 1): mean TTFT of the window's requests the fault
  never touched (never on a failed worker).
* Recovery time: against the run's own pre-fault level, the mean TTFT and per-token TPOT of
  the requests arriving in the PRE_FAULT_S before the fault. From the fault on, TTFT and TPOT
  are pooled over a sliding SMOOTH_BINS x bin_s window of arrivals; the system has recovered
  at the first bin from which RECOVERY_HOLD_BINS successive windows are both within
  RECOVERY_TOLERANCE above the level. Recovery time is that bin's start minus the fault
  time (0 if the fault never moved the metrics); None if it never recovers before the
  trace ends.
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

RECOVERY_TOLERANCE = 0.20
RECOVERY_HOLD_BINS = 3
SMOOTH_BINS = 6
PRE_FAULT_S = 120.0


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
    uninterrupted_mean_ttft_s: float  # the window's requests the fault never touched
    window_s: float                   # the impact window after the fault
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


def tpot_per_token(requests: Sequence[Req]) -> float:
    """Decode seconds over decode tokens (requests with one token decode none)."""
    tokens = sum(r.output - 1 for r in requests if r.output > 1)
    if not tokens:
        return math.nan
    return math.fsum(r.finish - r.first_token for r in requests if r.output > 1) / tokens


def recovery_of(result: SimResult, bin_s: float) -> float | None:
    """Recovery time of a faulted run against its own pre-fault level (module docstring);
    None without a fault or when it never recovers."""
    fault = result.fault
    if fault is None:
        return None
    reqs = result.requests
    pre = [r for r in reqs if fault.at - PRE_FAULT_S <= r.arrival < fault.at and r.epoch == 0]
    level_ttft = mean([ttft(r) for r in pre])
    level_tpot = tpot_per_token(pre)
    if not pre or math.isnan(level_ttft):
        return None
    last = max(r.arrival for r in reqs)
    bins = int((last - fault.at) // bin_s) + 1
    if bins < SMOOTH_BINS + RECOVERY_HOLD_BINS - 1:
        return None
    # Per bin from the fault on: TTFT sum and count, decode seconds and tokens.
    t_sum = [0.0] * bins
    count = [0] * bins
    d_sec = [0.0] * bins
    d_tok = [0] * bins
    for r in reqs:
        if r.arrival < fault.at:
            continue
        b = int((r.arrival - fault.at) // bin_s)
        t_sum[b] += ttft(r)
        count[b] += 1
        if r.output > 1:
            d_sec[b] += r.finish - r.first_token
            d_tok[b] += r.output - 1
    limit = 1.0 + RECOVERY_TOLERANCE

    def ok(b: int) -> bool:
        n = sum(count[b:b + SMOOTH_BINS])
        if n == 0:
            return True
        if sum(t_sum[b:b + SMOOTH_BINS]) / n > limit * level_ttft:
            return False
        tokens = sum(d_tok[b:b + SMOOTH_BINS])
        return (math.isnan(level_tpot) or tokens == 0
                or sum(d_sec[b:b + SMOOTH_BINS]) / tokens <= limit * level_tpot)

    for b in range(bins - SMOOTH_BINS - RECOVERY_HOLD_BINS + 2):
        if all(ok(b + j) for j in range(RECOVERY_HOLD_BINS)):
            return b * bin_s
    return None


def binned_ttft(requests: Sequence[Req], bin_s: float, bins: int) -> list[float | None]:
    sums = [0.0] * bins
    counts = [0] * bins
    for r in requests:
        b = int(r.arrival // bin_s)
        if 0 <= b < bins:
            sums[b] += ttft(r)
            counts[b] += 1
    return [s / c if c else None for s, c in zip(sums, counts, strict=True)]


def impact_window(recoveries: Sequence[float | None], result: SimResult,
                  bin_s: float) -> float:
    """The window after the fault that the compared runs' metrics are taken over: until
    the slowest has recovered (at least one bin); to the last arrival if one never does."""
    fault = result.fault
    last = max((r.arrival for r in result.requests), default=0.0)
    end = last - fault.at if fault is not None else last
    if any(r is None for r in recoveries) or not recoveries:
        return max(end, bin_s)
    return max(bin_s, *(r for r in recoveries if r is not None))


def summarize(
    policy: str, faulted: SimResult, reference: SimResult, window_s: float | None,
    bin_s: float,
) -> tuple[PolicyMetrics, Timeline]:
    """`window_s`: the impact window (None: until this run has recovered)."""
    reqs, ref = faulted.requests, reference.requests
    fault = faulted.fault
    recovery = recovery_of(faulted, bin_s)
    if window_s is None:
        window_s = impact_window([recovery], faulted, bin_s)
    if fault is None:
        lo, hi = -math.inf, math.inf
    else:
        lo, hi = fault.at, fault.at + window_s
    window = [r for r in reqs if lo <= r.arrival <= hi or r.epoch > 0]
    ids = [r.rid for r in window]
    tpots = [t for r in window if (t := tpot(r)) is not None]
    ref_window = [ref[i] for i in ids]
    interrupted = [r for r in reqs if r.interrupted_at >= 0]
    replays = [r.replay_first - r.interrupted_at for r in interrupted]
    on_failed = [r for r in reqs if r.resident_at_fault > 0]
    resident = math.fsum(r.resident_at_fault for r in on_failed)
    covered = sum(r.ckpt_tokens for r in on_failed)
    last_arrival = max((r.arrival for r in reqs), default=0.0)
    bins = int(last_arrival // bin_s) + 1
    f_bins, r_bins = binned_ttft(reqs, bin_s, bins), binned_ttft(ref, bin_s, bins)
    metrics = PolicyMetrics(
        policy=policy,
        requests=len(reqs),
        window_requests=len(window),
        mean_ttft_s=mean([ttft(r) for r in window]),
        p99_ttft_s=percentile([ttft(r) for r in window], 99),
        mean_tpot_s=tpot_per_token(window),
        p99_tpot_s=percentile(tpots, 99),
        baseline_mean_ttft_s=mean([ttft(r) for r in ref_window]),
        baseline_mean_tpot_s=tpot_per_token(ref_window),
        uninterrupted_mean_ttft_s=mean([ttft(r) for r in window if r.epoch == 0]),
        window_s=window_s,
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
