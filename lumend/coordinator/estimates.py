"""The cost figures cost-aware decisions use, measured by the engines where they can be.

Three figures of `PolicyConfig`'s cost model are measured:
* `restore_bytes_per_s`: checkpoint bytes restored / the seconds those restores took (both
  engine kinds count them where a resumed request loads its pages: lumend.engine
  .sim_checkpoint, lumend.engine.vllm_connector);
* `kv_bytes_per_token`: those bytes / the tokens whose KV they held (the model's, not the
  constant's: the policy turns a checkpointed prefix into bytes with it, so a restore's
  estimated time is in the units the bandwidth was measured in);
* `recompute_s_per_token`: the marginal seconds of one more prompt token in a step,
  fitted from the engines' own steps (`lumend.engine.step_fit`: least squares of step
  seconds on the step's extra tokens and sequences, from sums both engine kinds export),
  pooled over the workers. Until a fit is determined (enough steps, enough spread in their
  prompt tokens), prefill seconds / prompt tokens computed (vLLM's
  `vllm:request_prefill_time_seconds` and `vllm:prompt_tokens_by_source_total`, which the
  sim engine exports as well). vLLM counts each request's prefill as the whole of the steps
  it ran in, shared or not, and only when the request finishes: prefills that share steps
  each count the batch's time, so under concurrency that ratio is an upper bound on the
  marginal cost (the sim engine: 1.6x alone from the fixed step cost, about 8x with six
  prompts prefilled together), which leans recoveries to resuming and overstates
  draft-assist's verify cost: the fit replaces it as soon as it is determined.

Each worker's record carries its active engine's counters since that engine started
(`WorkerLoad`). An estimate is the ratio of their sums over the workers of one view: a
pure function of the store, so the coordinator decides with it, a newly elected coordinator
has it from its first view, and `lumenctl config show` computes the same figure from the
same records. A worker's counters are a sample; one is left out when it is too small to say
anything (under `MIN_RESTORE_BYTES` / `MIN_PREFILL_TOKENS`, or under `MIN_SECONDS`) or
absurd (not finite, negative, or a rate outside the plausible range). Counters that went
back to 0 (an engine restarted, or a shadow took over) are a smaller sample, not a
negative one. No usable sample: the default constant stays in use.

The two speeds are used as a pair. A recovery decision weighs a restore (bandwidth) against
a recompute (prefill seconds): with one of them measured on this hardware and the other a
constant from another (the defaults are Qwen3-32B on A100s), the comparison says nothing,
and it flips. On a cluster of sim engines, before they exported prefill time, a loopback
restore measured at 30-40 MB/s against the constant prefill made every recovery recompute.
So a measured speed whose partner is not measured is shown (`held`) but not used until it
is.
The KV bytes per token are a fact of the model, not a speed: used whenever measured.

The sums are over the engines' lifetimes, not a window: a bandwidth and a per-token cost are
properties of the hardware and the model, which do not drift while an engine runs.

A step time does drift with the batch, so draft-assist's predicted gain reads it from the
step counters' growth over a recent window (`StepTracker`, kept by the coordinator across
views; below, with the gain's other inputs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from lumend.assist.attach import DEFAULT_K as ATTACH_DEFAULT_K
from lumend.cluster.models import WorkerLoad, WorkerRecord
from lumend.coordinator.policy import PolicyConfig, assist_gain, in_seconds
from lumend.engine.step_fit import StepFitSums, solve
from lumend.engine.vllm_assist import DEFAULT_K as VLLM_DEFAULT_K

MIN_RESTORE_BYTES = 1 << 20  # 1 MiB: fewer bytes say more about latency than bandwidth
MIN_PREFILL_TOKENS = 256
MIN_SECONDS = 1e-4
# Plausible ranges: a restore between 1 MB/s and 10 TB/s, a prefill token between 10 ns and
# 1 s. Outside them a sample is a unit error or a broken clock, not a measurement.
RESTORE_RANGE = (1e6, 1e13)
PREFILL_RANGE = (1e-8, 1.0)
KV_RANGE = (1.0, float(1 << 27))  # KV bytes of one token: up to 128 MiB


@dataclass(frozen=True, slots=True)
class Estimate:
    """One figure of the cost model as decisions use it."""

    key: str  # the PolicyConfig field it sets
    value: float
    workers: int  # workers whose counters it is measured from; 0: the default constant
    amount: float = 0.0  # what they counted: bytes restored, or tokens prefilled
    over: float = 0.0  # what it is divided by or divides: seconds (kv: tokens restored)
    at: float | None = None  # when the newest of those workers' records was written
    # A speed measured while its partner was not: the value measured, not used (`value` is
    # the default constant until both are measured).
    held: Estimate | None = None
    # The prefill cost fitted from this many engine steps (the marginal cost, step_fit);
    # 0: from the per-request prefill time (an upper bound under concurrency).
    fit_steps: int = 0

    @property
    def measured(self) -> bool:
        return self.workers > 0

    @property
    def source(self) -> str:
        if self.held is not None:
            return (f"default (measured {self.held.value:.4g} from {self.held.workers} "
                    f"worker{'s' if self.held.workers != 1 else ''}, not used until "
                    f"{PARTNER[self.key]} is measured too)")
        if not self.measured:
            return "default"
        how = f", fitted from {self.fit_steps} steps" if self.fit_steps else ""
        return f"measured from {self.workers} worker{'s' if self.workers != 1 else ''}{how}"


@dataclass(frozen=True, slots=True)
class CostEstimates:
    restore: Estimate
    prefill: Estimate
    kv: Estimate

    @property
    def all(self) -> tuple[Estimate, Estimate, Estimate]:
        return (self.restore, self.prefill, self.kv)

    def apply(self, cfg: PolicyConfig) -> PolicyConfig:
        """`cfg` with the measured figures in place of its constants (and, cost-aware, its
        L_hat weights derived again from them, as `in_seconds` does)."""
        if not any(e.measured for e in self.all):
            return cfg
        cfg = replace(cfg, restore_bytes_per_s=self.restore.value if self.restore.measured
                      else cfg.restore_bytes_per_s,
                      recompute_s_per_token=self.prefill.value if self.prefill.measured
                      else cfg.recompute_s_per_token,
                      kv_bytes_per_token=self.kv.value if self.kv.measured
                      else cfg.kv_bytes_per_token)
        return in_seconds(cfg) if cfg.cost_aware else cfg

    def rows(self, now: float) -> list[dict[str, object]]:
        """One row per figure, for `lumenctl config show`: key, value, source (measured or
        default), workers, what was measured (`amount` of `unit[0]` over `over` of
        `unit[1]`), age (seconds since the newest record it is measured from was written;
        None: the default), meaning."""
        return [{"key": e.key, "value": e.value, "source": "measured" if e.measured
                 else "held" if e.held is not None else "default", "workers": e.workers,
                 "amount": e.amount, "over": e.over, "unit": UNITS[e.key],
                 "age_s": None if e.at is None else max(0.0, now - e.at),
                 "fit_steps": e.fit_steps,
                 "held": None if e.held is None else {
                     "value": e.held.value, "workers": e.held.workers,
                     "amount": e.held.amount, "over": e.held.over,
                     "waits_for": PARTNER[e.key]},
                 "meaning": MEANINGS[e.key]}
                for e in self.all]

    def differs(self, other: CostEstimates, by: float = 0.05) -> bool:
        """Whether a figure changed source or value by more than `by` (relative)."""
        return any(a.measured != b.measured or abs(a.value - b.value) > by * abs(b.value)
                   for a, b in zip(self.all, other.all, strict=True))

    def describe(self) -> str:
        """One line for the log: both figures and where they come from."""
        return (f"restore bandwidth {self.restore.value / 1e9:.3g} GB/s ({self.restore.source})"
                f", KV {self.kv.value / 1024:.4g} KiB per token ({self.kv.source}), prefill "
                f"{self.prefill.value * 1e6:.3g} us per token ({self.prefill.source})")


PARTNER = {"restore_bytes_per_s": "recompute_s_per_token",
           "recompute_s_per_token": "restore_bytes_per_s"}
UNITS = {"restore_bytes_per_s": ("bytes", "s"), "recompute_s_per_token": ("tokens", "s"),
         "kv_bytes_per_token": ("bytes", "tokens")}
MEANINGS = {
    "restore_bytes_per_s": "restore bandwidth: checkpoint bytes loaded per second by a "
                           "resumed request (measured: bytes restored / seconds restoring)",
    "recompute_s_per_token": "prefill seconds per prompt token (measured: the marginal "
                             "cost fitted from the engines' steps, else vLLM's prefill "
                             "time / prompt tokens computed)",
    "kv_bytes_per_token": "KV cache bytes of one token, to turn a checkpointed prefix into "
                          "bytes to restore (measured: bytes restored / their tokens)",
}


def estimate(workers: Iterable[WorkerRecord], defaults: PolicyConfig | None = None
             ) -> CostEstimates:
    """The estimates from the workers' counters; the defaults' constants where none is
    usable."""
    cfg = defaults or PolicyConfig()
    records = list(workers)
    restore = _ratio([(w.load.restored_bytes, w.load.restore_s, w.updated_at)
                      for w in records], MIN_RESTORE_BYTES, RESTORE_RANGE, per_second=True)
    prefill = _ratio([(w.load.prefill_tokens, w.load.prefill_s, w.updated_at)
                      for w in records], MIN_PREFILL_TOKENS, PREFILL_RANGE, per_second=False)
    # Bytes per token from the same restores (a "rate" of bytes per token: per_second).
    kv = _ratio([(w.load.restored_bytes, w.load.restored_tokens, w.updated_at)
                 for w in records if _usable_restore(w.load)], MIN_RESTORE_BYTES, KV_RANGE,
                per_second=True, min_seconds=1.0)
    restore_e = _estimate("restore_bytes_per_s", restore, cfg.restore_bytes_per_s,
                          per_second=True)
    prefill_e = (_fitted_prefill(records)
                 or _estimate("recompute_s_per_token", prefill, cfg.recompute_s_per_token,
                              per_second=False))
    if restore_e.measured != prefill_e.measured:  # the speeds are used as a pair
        if restore_e.measured:
            restore_e = Estimate(restore_e.key, cfg.restore_bytes_per_s, 0, held=restore_e)
        else:
            prefill_e = Estimate(prefill_e.key, cfg.recompute_s_per_token, 0, held=prefill_e)
    return CostEstimates(
        restore=restore_e, prefill=prefill_e,
        kv=_estimate("kv_bytes_per_token", kv, cfg.kv_bytes_per_token, per_second=True))


def _fitted_prefill(records: list[WorkerRecord]) -> Estimate | None:
    """The marginal seconds of a prompt token, fitted from the steps of every worker that
    exports the fit's sums (their sums pooled: one model and hardware per cluster, as the
    other figures assume); None where no fit is determined or plausible."""
    pooled, workers, newest = StepFitSums(), 0, None
    for w in records:
        if w.load.step_fit is None:
            continue
        try:
            sums = StepFitSums.of(w.load.step_fit)
        except ValueError:
            continue
        if not all(math.isfinite(v) and v >= 0 for v in sums.values()):
            continue
        pooled, workers = pooled + sums, workers + 1
        newest = w.updated_at if newest is None else max(newest, w.updated_at)
    fit = solve(pooled) if workers else None
    if fit is None or not PREFILL_RANGE[0] <= fit.per_token_s <= PREFILL_RANGE[1]:
        return None
    return Estimate("recompute_s_per_token", fit.per_token_s, workers, pooled.p,
                    fit.per_token_s * pooled.p, newest, fit_steps=fit.steps)


def _usable_restore(load: WorkerLoad) -> bool:
    return _ratio([(load.restored_bytes, load.restore_s, 0.0)], MIN_RESTORE_BYTES,
                  RESTORE_RANGE, per_second=True)[0] == 1


Sums = tuple[int, float, float, float | None]


def _ratio(samples: Iterable[tuple[float | None, float | None, float]], min_amount: float,
           plausible: tuple[float, float], *, per_second: bool,
           min_seconds: float = MIN_SECONDS) -> Sums:
    """(usable samples, their amounts' sum, their seconds' (or tokens') sum, the newest
    one's time)."""
    n, amount, seconds = 0, 0.0, 0.0
    newest: float | None = None
    low, high = plausible
    for a, s, at in samples:
        if a is None or s is None or not (math.isfinite(a) and math.isfinite(s)):
            continue
        if a < min_amount or s < min_seconds:
            continue
        rate = a / s if per_second else s / a
        if not low <= rate <= high:
            continue
        n, amount, seconds = n + 1, amount + a, seconds + s
        newest = at if newest is None else max(newest, at)
    return n, amount, seconds, newest


def _estimate(key: str, sums: Sums, default: float, *, per_second: bool) -> Estimate:
    n, amount, seconds, at = sums
    if n == 0:
        return Estimate(key, default, 0)
    return Estimate(key, amount / seconds if per_second else seconds / amount, n, amount,
                    seconds, at)


# -- draft-assist's predicted gain (Algorithm 3 by gain, policy.assist_gain) ----------------
#
# The simulator knows each worker's step from its cost model; the coordinator measures it.
# Per worker the tracker keeps the step counters of the records it saw (cumulative since
# the active engine started, exact; a record whose counters alone grew is written every
# COUNTER_REFRESH_S, lumend.cluster.agent) and reads a recent step time from their growth:
# between the newest record and the newest older one at least MIN_STEP_SPAN_S before it
# over which at least MIN_STEPS steps were counted, within STEP_WINDOW_S. Counters that
# went back (a restarted engine) or another active engine start the window anew; no such
# pair: no step time, and the coordinator falls back to the most loaded by L_hat.
# Why exact: rounded relative to their total (10 significant bits, as they once were), a
# window's growth falls inside the rounding after about four hours of a busy engine, and
# the gain was silently replaced by that fallback for the rest of the engine's life.
#
# The gain's other inputs, from the same record and the cost model in use:
# * verify_extra_s: verifying k drafted tokens per running sequence computes them like
#   prompt tokens: running * k * the prefill seconds per token in use (measured where the
#   engines export prefill time, else PolicyConfig's constant), plus ASSIST_ROUND_S, the
#   round trip to the drafter (its k draft steps and the network) the survivor waits for;
#   k is the engines' default draft length (ASSIST_K, by engine kind);
# * tokens_per_round: 1 + k * the acceptance measured by this model's current assignments
#   (accepted / drafted tokens, once MIN_DRAFTED were verified), else the prior the
#   simulator uses (per-token agreement ASSIST_PRIOR_AGREEMENT: 1 + a + ... + a^k);
# * prefill_waiting: requests waiting; capacity_bound: waiting with the KV cache at least
#   KV_BOUND full (prefill waits for pages, which faster decoding frees sooner);
# * prefill_share: the share of the window's wall time spent computing prompt tokens
#   (their growth * the prefill seconds per token / the window), 0 where not resolved.
# A survivor running nothing has nothing to speed up: gain 0, no step time needed.

STEP_WINDOW_S = 120.0
MIN_STEP_SPAN_S = 2.0
MIN_STEPS = 16
MIN_DRAFTED = 64
KV_BOUND = 0.9
ASSIST_PRIOR_AGREEMENT = 0.6  # lumend.sim.config.SimConfig.spec_acceptance
# The drafter's round trip, a prior (no engine exports how long it waits for drafts): k = 4
# draft tokens at sim-draft's 0.5 ms each, plus a LAN round trip (the simulator's
# assist_rtt_s, 1 ms).
ASSIST_ROUND_S = 0.003
ASSIST_K = {"sim": ATTACH_DEFAULT_K, "vllm": VLLM_DEFAULT_K}


@dataclass(frozen=True, slots=True)
class StepSample:
    at: float  # the record's updated_at
    engine: str  # its active engine
    step_s: float
    steps: int
    prefill_tokens: int | None


@dataclass(frozen=True, slots=True)
class StepRate:
    """One worker's steps over a recent window."""

    step_s: float  # mean seconds per step
    steps: int  # steps counted in the window
    span_s: float  # the window (wall seconds between the two records)
    prefill_tokens: int | None  # prompt tokens computed in it; None: not resolved


class StepTracker:
    """Recent step times per worker from the step counters of the records seen."""

    def __init__(self, window_s: float = STEP_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: dict[str, list[StepSample]] = {}

    def observe(self, workers: Iterable[WorkerRecord]) -> None:
        seen = set()
        for w in workers:
            seen.add(w.name)
            load = w.load
            active = [e.id for e in w.engines if e.role == "active"]
            if load.step_s is None or load.steps is None or not active:
                self._samples.pop(w.name, None)
                continue
            sample = StepSample(w.updated_at, active[0], load.step_s, load.steps,
                                load.prefill_tokens)
            history = self._samples.setdefault(w.name, [])
            if history:
                last = history[-1]
                if sample.at <= last.at:
                    continue  # the same record (or an older one, read late)
                if (sample.engine != last.engine or sample.steps < last.steps
                        or sample.step_s < last.step_s):
                    history.clear()  # another engine, or this one restarted
            history.append(sample)
            while history[0].at < sample.at - self.window_s:
                del history[0]
        for name in set(self._samples) - seen:
            del self._samples[name]

    def rate(self, worker: str, since: float | None = None) -> StepRate | None:
        """The recent mean step time, from the newest record and the newest older one
        with enough growth; `since`: only records from then on (steps taken after it)."""
        history = self._samples.get(worker)
        if since is not None and history:
            history = [s for s in history if s.at >= since]
        if not history:
            return None
        new = history[-1]
        for old in reversed(history[:-1]):
            d_steps, d_s = new.steps - old.steps, new.step_s - old.step_s
            if new.at - old.at < MIN_STEP_SPAN_S or d_steps < MIN_STEPS or d_s <= 0:
                continue
            prefill = None
            if new.prefill_tokens is not None and old.prefill_tokens is not None:
                prefill = max(0, new.prefill_tokens - old.prefill_tokens)
            return StepRate(d_s / d_steps, d_steps, new.at - old.at, prefill)
        return None


def draft_tokens(engine: str) -> int:
    """k: tokens a drafter proposes per round to an engine of this kind (its default)."""
    return ASSIST_K.get(engine, ATTACH_DEFAULT_K)


def tokens_per_round(k: int, drafted: int = 0, accepted: int = 0) -> float:
    """Tokens a verify step emits per sequence: 1 + k * acceptance where MIN_DRAFTED were
    verified, else the prior (1 + a + ... + a^k, a = ASSIST_PRIOR_AGREEMENT)."""
    if drafted >= MIN_DRAFTED:
        return 1.0 + k * min(1.0, max(0.0, accepted / drafted))
    return math.fsum(ASSIST_PRIOR_AGREEMENT ** i for i in range(k + 1))


@dataclass(frozen=True, slots=True)
class AssistInputs:
    """policy.assist_gain's arguments for one survivor, and the gain."""

    step_s: float
    verify_extra_s: float
    tokens_per_round: float
    prefill_waiting: bool
    capacity_bound: bool
    prefill_share: float
    objective: str = "ttft"  # PolicyConfig.assist_objective: what the gain weighs

    @property
    def gain(self) -> float:
        if self.step_s <= 0:  # nothing decoding: nothing to speed up
            return 0.0
        return assist_gain(self.step_s, self.verify_extra_s, self.tokens_per_round,
                           self.prefill_waiting, self.capacity_bound, self.prefill_share,
                           self.objective)

    def describe(self) -> str:
        if self.step_s <= 0:
            return "nothing running"
        why = ("prefill waits for KV" if self.capacity_bound else "prefill waiting"
               if self.prefill_waiting else f"prefill share {self.prefill_share:.2f}")
        return (f"step {self.step_s * 1e3:.3g} ms, verify +{self.verify_extra_s * 1e3:.3g} "
                f"ms, {self.tokens_per_round:.2f} tokens per round, {why}")


# An assignment is judged on its own steps once its drafts had time to arrive (the attach,
# the first rounds) and enough of them were verified; it ends when its measured gain is
# below -HURT_MARGIN (noise in two step means is a few per cent), and that drafter is not
# given that survivor again for a cooldown that doubles each time (HURT_COOLDOWN_S up to
# HURT_COOLDOWN_MAX_S), so a gain that only the prediction sees does not flap on and off.
ASSIST_SETTLE_S = 5.0
MIN_JUDGED_DRAFTS = 4 * MIN_DRAFTED
HURT_MARGIN = 0.05
HURT_COOLDOWN_S = 30.0
HURT_COOLDOWN_MAX_S = 600.0


def measured_inputs(load: WorkerLoad, before_s: float, assisted: StepRate, tpr: float,
                    prefill_s_per_token: float, objective: str = "ttft"
                    ) -> AssistInputs | None:
    """The gain's inputs for a survivor being assisted, from what was measured: its step
    time before the drafts (`before_s`) and with them (`assisted`), the verify cost being
    their difference, and the acceptance (`tpr`); None when there is no before to compare
    with or it runs nothing. Same rule as the prediction (policy.assist_gain), so a
    prediction that was right keeps the assignment and one that was wrong ends it."""
    if before_s <= 0 or load.running <= 0:
        return None
    predicted = assist_inputs(load, assisted, 0, tpr, prefill_s_per_token, objective)
    assert predicted is not None  # it runs something and has a step rate
    return dataclasses.replace(predicted, step_s=before_s,
                               verify_extra_s=max(0.0, assisted.step_s - before_s))


def assist_inputs(load: WorkerLoad, rate: StepRate | None, k: int, tpr: float,
                  prefill_s_per_token: float, objective: str = "ttft"
                  ) -> AssistInputs | None:
    """The gain's inputs for a survivor with this load and recent steps; None when it runs
    something and its step time is not known."""
    if load.running <= 0:
        return AssistInputs(0.0, 0.0, tpr, load.waiting > 0, False, 0.0, objective)
    if rate is None:
        return None
    share = 0.0
    if rate.prefill_tokens is not None and rate.span_s > 0:
        share = min(1.0, rate.prefill_tokens * prefill_s_per_token / rate.span_s)
    waiting = load.waiting > 0
    return AssistInputs(
        step_s=rate.step_s,
        verify_extra_s=load.running * k * prefill_s_per_token + ASSIST_ROUND_S,
        tokens_per_round=tpr, prefill_waiting=waiting,
        capacity_bound=waiting and load.kv_usage >= KV_BOUND, prefill_share=share,
        objective=objective)
