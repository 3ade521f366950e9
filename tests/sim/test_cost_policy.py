"""Issue 15: cost-aware decisions (seconds, not requests), measured the paper's way."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lumend.coordinator import policy
from lumend.coordinator.policy import GIB, LoadSnapshot, Mode, PolicyConfig, WorkerLoad
from lumend.sim.config import FaultKind, FaultSpec, SimConfig, apply_policy, named_policy
from lumend.sim.engine import FaultRecord, SimResult, simulate
from lumend.sim.metrics import recovery_of, tpot_per_token
from lumend.sim.stats import interval, paired_ratio
from lumend.sim.workload import Workload, synthetic

COST = PolicyConfig(cost_aware=True, admission="queue", alpha=1 / 25e9, beta=0.1,
                    restore_bytes_per_s=25e9, recompute_s_per_token=1e-4,
                    kv_bytes_per_token=262144.0)


def snap(queue: list[int], work: list[float] | None = None, held: list[float] | None = None,
         alive: list[bool] | None = None, gains: list[float] | None = None) -> LoadSnapshot:
    n = len(queue)
    return LoadSnapshot(nodes=[f"n{i}" for i in range(n)], ckpt_bytes=held or [0.0] * n,
                        queue=queue, budget_bytes=[math.inf] * n, alive=alive or [True] * n,
                        work_s=work, assist_gain=gains)


# -- Algorithm 2 by estimated completion time ----------------------------------------------


def test_routing_never_picks_the_option_its_own_estimate_says_is_slower() -> None:
    rng = random.Random(7)
    resumed = recomputed = 0
    for _ in range(2000):
        n = rng.randint(2, 6)
        queue = [rng.randint(0, 40) for _ in range(n)]
        work = [rng.uniform(0, 8) for _ in range(n)]
        alive = [rng.random() > 0.2 for _ in range(n)]
        s = snap(queue, work, alive=alive)
        holder = rng.choice([None, *range(n)])
        blocks = rng.randint(0, 300)
        total = blocks * 16 + rng.randint(1, 64)
        cfg = replace(COST, delay_weight=rng.choice([0.0, 1.0]),
                      restore_bytes_per_s=rng.choice([1e9, 25e9]))
        route = policy.recover(s, holder, blocks, cfg, total)
        resume, target, recompute = policy.completion_estimates(s, holder, blocks, total, cfg)
        if not any(alive):
            assert route is None
            continue
        assert route is not None
        if route.resume:
            resumed += 1
            assert route.worker == holder and resume <= recompute
        else:
            recomputed += 1
            assert route.worker == target and recompute < resume
            assert alive[route.worker]
    assert resumed > 100 and recomputed > 100  # both branches exercised


def estimate(s: LoadSnapshot, worker: int, own_s: float, cfg: PolicyConfig) -> float:
    """The policy's cost of running `own_s` seconds of a request's work on `worker`, written
    out here: queued work + own seconds x (1 + delay_weight x queue)."""
    return policy.work(s, cfg)[worker] + own_s * (1.0 + cfg.delay_weight * s.queue[worker])


@st.composite
def routing_cases(draw: st.DrawFn) -> tuple[LoadSnapshot, int | None, int, int, PolicyConfig]:
    n = draw(st.integers(1, 8))
    queue = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    alive = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    # Work as the simulator gives it (seconds per worker), as the coordinator's counts-only
    # views do (beta x the requests not yet running), or none (beta x queue).
    form = draw(st.sampled_from(["given", "counts", "none"]))
    beta = draw(st.sampled_from([0.0, 0.1155, 0.5]))
    work: list[float] | None = None
    if form == "given":
        work = draw(st.lists(st.floats(0, 30), min_size=n, max_size=n))
    elif form == "counts":
        running = [draw(st.integers(0, q)) for q in queue]
        work = [beta * (q - r) for q, r in zip(queue, running, strict=True)]
    cfg = replace(COST, beta=beta, delay_weight=draw(st.sampled_from([0.0, 0.5, 1.0])),
                  restore_bytes_per_s=draw(st.sampled_from([1e9, 25e9])),
                  restore_beside_engine=draw(st.booleans()),
                  recompute_s_per_token=draw(st.sampled_from([0.0, 1e-4, 4e-4])))
    holder = draw(st.sampled_from([None, *range(n)]))
    blocks = draw(st.integers(0, 300))
    total = blocks * 16 + draw(st.integers(1, 64))
    return snap(queue, work, alive=alive), holder, blocks, total, cfg


@settings(max_examples=600, deadline=None)
@given(routing_cases())
def test_recompute_target_is_admissions_choice_and_routing_never_picks_a_slower_option(
    case: tuple[LoadSnapshot, int | None, int, int, PolicyConfig],
) -> None:
    """The recompute target is the survivor admission would pick (`least_loaded`: the
    shortest queue, lowest index among ties), where stop-and-restart recomputes; its cost
    is the estimate written out (queued work + own seconds x (1 + delay_weight x queue)),
    and the route is never strictly slower, by that estimate, than the other option it
    compares: resuming at the holder or recomputing at the target."""
    s, holder, blocks, total, cfg = case
    resume, target, recompute = policy.completion_estimates(s, holder, blocks, total, cfg)
    route = policy.recover(s, holder, blocks, cfg, total)
    live = [i for i, ok in enumerate(s.alive) if ok]
    if not live:
        assert target is None and recompute == math.inf and route is None
        return
    assert target == min(live, key=lambda i: (s.queue[i], i))
    assert target == policy.least_loaded(s, cfg)
    assert recompute == estimate(s, target, policy.recompute_s(total, cfg), cfg)
    options = [recompute]
    if resume != math.inf:
        assert holder is not None
        tokens = min(blocks * cfg.block_tokens, total - 1)
        restore = policy.restore_s(tokens, cfg)
        rest = policy.recompute_s(total - tokens, cfg)
        if cfg.restore_beside_engine:  # overlaps the queued work; only `rest` delays others
            queued = policy.work(s, cfg)[holder]
            assert resume == pytest.approx(max(queued, restore) + estimate(s, holder, rest, cfg)
                                           - queued)
        else:
            assert resume == estimate(s, holder, restore + rest, cfg)
        options.append(resume)
    assert route is not None and s.alive[route.worker]
    chosen = resume if route.resume else recompute
    assert chosen <= min(options)
    assert route.resume or route.worker == target


@settings(max_examples=600, deadline=None)
@given(routing_cases())
def test_a_request_lumen_recomputes_goes_where_stop_and_restart_sends_it(
    case: tuple[LoadSnapshot, int | None, int, int, PolicyConfig],
) -> None:
    """Issue 15: without a usable checkpoint (or when recomputing is estimated faster than
    resuming) LUMEN recomputes where stop-and-restart does. The least-estimate target of
    `ab47bb0` failed this: it sent short requests to survivors with no queued prefill but
    more requests, and lost 2-3% mean TTFT to stop-and-restart in the sweep's 1 GB/s cells
    (docs/simulator.md, *Sweep*; bench/sweep_losses.py)."""
    s, holder, blocks, total, cfg = case
    restart = policy.restart_route(s, cfg)
    route = policy.recover(s, holder, blocks, cfg, total)
    assert policy.recover(s, None, 0, cfg, total) == restart
    if route is not None and not route.resume:
        assert route == restart


def test_recompute_target_is_the_shorter_queue_not_the_least_estimate() -> None:
    # Worker 0: 10 requests decoding, nothing queued (work 0); worker 1: 6 requests, 1 s of
    # queued prefill. Recomputing a mean prompt (0.1155 s) is estimated to finish sooner at
    # 0 (0 + 0.1155 x 11 = 1.27 s) than at 1 (1 + 0.1155 x 7 = 1.81 s), which is where the
    # least-estimate target sent it; the target is now worker 1, as for stop-and-restart.
    cfg = replace(COST, beta=0.1155)
    s = snap([10, 6], [0.0, 1.0])
    _, target, recompute = policy.completion_estimates(s, None, 0, 1155, cfg)
    assert target == 1 and recompute == pytest.approx(1.0 + 0.1155 * 7)
    assert policy.recover(s, None, 0, cfg, 1155) == policy.Route(1, resume=False)
    assert policy.restart_route(s, cfg) == policy.Route(1, resume=False)
    # Ties in the queue go to the lower index, as admission's.
    assert policy.completion_estimates(snap([4, 2, 2], [0.0, 5.0, 0.0]), None, 0, 0, cfg)[1] == 1


def test_routing_resumes_unless_the_holder_is_far_behind() -> None:
    # Equal queues: restoring 64 blocks (1024 tokens, 11 ms) beats recomputing them (0.1 s).
    assert policy.recover(snap([5, 5], [1.0, 1.0]), 0, 64, COST, 1030) == policy.Route(0, True)
    # The holder has 30 s of queued work, the other worker none: recompute there.
    far = policy.recover(snap([5, 0], [30.0, 0.0]), 0, 64, COST, 1030)
    assert far == policy.Route(1, False)
    # Same gap, but 400 requests share the recompute target's steps (500 the holder's): the
    # 0.1 s of extra prefill delays each of them, the 11 ms restore far less, so resuming is
    # cheaper for the cluster (30 + 0.011 x 501 = 35 s against 0.1 x 401 = 41 s).
    crowded = policy.recover(snap([500, 400], [30.0, 0.0]), 0, 64, COST, 1030)
    assert crowded == policy.Route(0, True)
    # Without the delay term (pure per-request completion) it recomputes.
    alone = policy.recover(snap([500, 400], [30.0, 0.0]), 0, 64,
                           replace(COST, delay_weight=0.0), 1030)
    assert alone == policy.Route(1, False)


def test_a_restore_beside_the_engine_overlaps_the_holders_queue() -> None:
    """3200 tokens at 1 GB/s: 0.84 s of restore against 0.32 s of recompute. Inside the
    holder's step the restore stalls its 5 requests too, and recomputing is cheaper; beside
    the engine it runs while the holder's 1 s of queued work does and delays nobody, and
    resuming is cheaper (negative control: the same case with restores in the step)."""
    slow = replace(COST, restore_bytes_per_s=1e9)
    equal = snap([5, 5], [1.0, 1.0])
    beside = policy.completion_estimates(equal, 1, 200, 3210, slow)
    in_step = policy.completion_estimates(equal, 1, 200, 3210,
                                          replace(slow, restore_beside_engine=False))
    assert beside[0] == pytest.approx(1.0 + 10 * 1e-4 * 6)
    assert in_step[0] == pytest.approx(1.0 + (3200 * 262144 / 1e9 + 10 * 1e-4) * 6)
    assert beside[2] == in_step[2] == pytest.approx(1.0 + 3210 * 1e-4 * 6)
    assert policy.recover(equal, 1, 200, slow, 3210) == policy.Route(1, True)
    assert policy.recover(equal, 1, 200, replace(slow, restore_beside_engine=False),
                          3210) == policy.Route(0, False)


def test_the_paper_forms_stay_the_default() -> None:
    """The coordinator's default PolicyConfig still routes by theta/tau (Eq. 6)."""
    cfg = PolicyConfig(theta=10.0, tau=8)
    loaded = snap([20, 0])
    assert policy.recover(loaded, 0, 4, cfg) == policy.Route(1, False)   # overloaded, short
    assert policy.recover(loaded, 0, 9, cfg) == policy.Route(0, True)    # longer than tau
    assert policy.recover(snap([5, 0]), 0, 4, cfg) == policy.Route(0, True)


def test_admission_by_queue_ignores_held_checkpoints() -> None:
    s = snap([3, 4], held=[40 * GIB, 0.0])
    assert policy.least_loaded(s, PolicyConfig()) == 1               # L_hat: 43 vs 4
    assert policy.least_loaded(s, PolicyConfig(admission="queue")) == 0
    with pytest.raises(ValueError, match="admission"):
        PolicyConfig(admission="random")


def test_snapshot_columns_from_workers_are_optional() -> None:
    rows = [WorkerLoad("a", "n0", 0.0, 1, work_s=0.5, assist_gain=0.1),
            WorkerLoad("b", "n1", 0.0, 2, work_s=1.5, assist_gain=-0.2)]
    s = LoadSnapshot.from_workers(rows)
    assert s.work_s == (0.5, 1.5) and s.assist_gain == (0.1, -0.2)
    partial = LoadSnapshot.from_workers([rows[0], WorkerLoad("c", "n1", 0.0, 2)])
    assert partial.work_s is None and partial.assist_gain is None
    # Without work_s, queued work is beta seconds per queued request.
    assert policy.work(partial, COST) == [0.1, 0.2]


# -- Algorithm 3 by predicted gain ------------------------------------------------------------


def test_assist_gain_is_off_where_prefill_pays_for_it() -> None:
    # Decode only: 2.3 tokens per round for 20% more step time is a gain.
    assert policy.assist_gain(0.05, 0.01, 2.3, prefill_waiting=False) > 0
    # Prefill waiting on compute: every longer step delays it.
    assert policy.assist_gain(0.05, 0.01, 2.3, prefill_waiting=True) < 0
    # ... unless prefill waits for batch slots or KV: faster decoding frees them.
    assert policy.assist_gain(0.05, 0.01, 2.3, prefill_waiting=True, capacity_bound=True) > 0
    # Verifying costs more than it brings (large compute-bound batch).
    assert policy.assist_gain(0.05, 0.08, 2.3, prefill_waiting=False) < 0
    # Some steps carried prefill lately, none waits now: each prompt that arrives would
    # wait 20% longer for its first token, and the objective "ttft" (the default) says no
    # however few they are; "throughput" weighs the decode gain (+92%) on the steps that
    # decode only against that slowdown on the others.
    for share in (0.01, 0.5, 0.9):
        assert policy.assist_gain(0.05, 0.01, 2.3, prefill_waiting=False,
                                  prefill_share=share) == pytest.approx(-0.2)
    def throughput(share: float) -> float:
        return policy.assist_gain(0.05, 0.01, 2.3, prefill_waiting=False, prefill_share=share,
                                  objective="throughput")
    assert throughput(0.9) < 0 < throughput(0.5)
    # Both agree where nothing competes (no prefill lately) or prefill waits for capacity.
    for objective in ("ttft", "throughput"):
        assert policy.assist_gain(0.05, 0.01, 2.3, False, objective=objective) > 0
        assert policy.assist_gain(0.05, 0.01, 2.3, True, True, 0.5, objective) > 0
        assert policy.assist_gain(0.05, 0.01, 2.3, True, False, 0.0, objective) < 0
    with pytest.raises(ValueError, match="assist_objective must be one of ttft, throughput"):
        PolicyConfig(assist_objective="latency")


def test_assist_target_is_the_highest_positive_gain() -> None:
    cfg = replace(COST, mode=Mode.lumen)
    assert policy.assist_target(snap([1, 2, 3], gains=[0.1, 0.4, 0.2]), cfg) == 1
    assert policy.assist_target(snap([1, 2, 3], gains=[-0.1, 0.0, -0.3]), cfg) is None
    dead = snap([1, 2, 3], gains=[0.1, 0.4, 0.2], alive=[True, False, True])
    assert policy.assist_target(dead, cfg) == 2
    assert policy.assist_target(snap([1, 2, 3]), cfg) is None  # gains unknown: no assist
    # The paper's form: the most loaded, whatever the gain.
    assert policy.assist_target(snap([1, 5, 3], gains=[-1.0, -1.0, -1.0]), PolicyConfig()) == 1


# -- the simulator ---------------------------------------------------------------------------

MODEL, GPU = "sim-small", "h100-tp4"


@cache
def loaded() -> Workload:
    return synthetic(rate=4 * 35.0, duration_s=100.0, seed=3)


@cache
def sim(name: str, fault: FaultKind = FaultKind.worker, model: str = MODEL,
        workload: str = "loaded") -> SimResult:
    base = SimConfig(workers=4, model=model, gpu=GPU if model == MODEL else "a100-tp4",
                     fault=FaultSpec(kind=fault, at_s=40.0))
    wl = loaded() if workload == "loaded" else decode_heavy()
    return simulate(wl, apply_policy(base, name))


@cache
def decode_heavy() -> Workload:
    rng = random.Random(1)
    arrivals, t = [], 0.0
    while t < 150:
        t += rng.expovariate(1.2)
        arrivals.append(t)
    return Workload(arrivals, [100] * len(arrivals), [600] * len(arrivals))


def test_failure_free_lumen_serves_exactly_like_stop_and_restart() -> None:
    lumen = sim("lumen", FaultKind.none)
    restart = sim("stop_and_restart", FaultKind.none)
    assert [r.first_token for r in lumen.requests] == [r.first_token for r in restart.requests]
    # Control: the paper's admission by L_hat (checkpoint GiB in the score) serves otherwise.
    paper = sim("lumen_paper", FaultKind.none)
    assert [r.first_token for r in paper.requests] != [r.first_token for r in restart.requests]


def test_cost_aware_assist_stays_off_at_loaded_survivors_and_runs_when_it_pays() -> None:
    assert sim("lumen_paper").assists            # the paper's assist: always
    assert not sim("lumen").assists               # survivors busy with prefill: no gain
    light = sim("lumen", model="qwen3-32b", workload="decode")
    assert light.assists and light.draft_rounds > 0


def test_named_policies_decide_in_seconds() -> None:
    cfg = apply_policy(SimConfig(model="qwen3-32b"), "lumen")
    assert cfg.policy.cost_aware and cfg.policy.admission == "queue"
    assert cfg.policy.alpha == pytest.approx(1 / cfg.restore_bytes_per_s)
    assert cfg.policy.kv_bytes_per_token == 262144
    paper = named_policy("lumen_paper", PolicyConfig())
    assert not paper.cost_aware and paper.admission == "lhat"
    for base in ("stop_and_restart", "fixed_checkpoint"):
        assert named_policy(base, PolicyConfig()).admission == "queue"


# -- metrics the paper's way -----------------------------------------------------------------


def test_recovery_is_zero_without_a_fault_and_positive_with_one() -> None:
    healthy = sim("stop_and_restart", FaultKind.none)
    assert recovery_of(healthy, 10.0) is None  # no fault, nothing to recover from
    # Negative control: a fault record on the failure-free run changes no metric.
    pretend = replace(healthy, fault=FaultRecord(40.0, [], [], None))
    assert recovery_of(pretend, 5.0) == 0.0
    base = SimConfig(workers=4, model=MODEL, gpu=GPU, fault=FaultSpec(FaultKind.worker, 40.0))
    longer = synthetic(rate=4 * 35.0, duration_s=250.0, seed=3)
    faulted = simulate(longer, apply_policy(base, "stop_and_restart"))
    rec = recovery_of(faulted, 5.0)
    # Back after the reload (2 GB / 3 GB/s + 20 s) and the backlog it left.
    assert rec is not None and 21.0 <= rec < 150.0


def test_tpot_is_per_token() -> None:
    w = Workload([0.0, 0.0], [10, 10], [2, 11])
    (a, b) = simulate(w, apply_policy(SimConfig(workers=1, model=MODEL, gpu=GPU),
                                      "stop_and_restart")).requests
    decode = (a.finish - a.first_token) + (b.finish - b.first_token)
    assert tpot_per_token([a, b]) == pytest.approx(decode / 11)
    per_request = ((a.finish - a.first_token) / 1 + (b.finish - b.first_token) / 10) / 2
    assert tpot_per_token([a, b]) != pytest.approx(per_request)


def test_interval_and_paired_ratio_known_answers() -> None:
    m, half = interval([1.0, 2.0, 3.0, 4.0, 5.0])
    # mean 3, sd sqrt(2.5), t(4) = 2.776: 2.776 * sqrt(2.5 / 5)
    assert m == 3.0 and half == pytest.approx(2.776 * math.sqrt(0.5))
    assert interval([2.0]) == (2.0, 0.0)
    ratio, spread = paired_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert ratio == pytest.approx(2.0) and spread == pytest.approx(0.0)
    with pytest.raises(ValueError, match="unpaired"):
        paired_ratio([1.0], [1.0, 2.0])
