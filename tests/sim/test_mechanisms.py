"""Detection delay, shadow engines, dual-replica checkpoints, link contention, eviction."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest

from lumend.config import EVICTIONS as PRODUCT_EVICTIONS
from lumend.config import CheckpointSection, EtcdSection
from lumend.coordinator import policy
from lumend.coordinator.policy import GIB
from lumend.engine.costmodel import load_cost_model
from lumend.failover.supervisor import SupervisorTiming
from lumend.sim.config import EVICTIONS, VARIANTS, FaultKind, FaultSpec, SimConfig, apply_policy
from lumend.sim.engine import Req, SimResult, Simulation, simulate
from lumend.sim.metrics import mean
from lumend.sim.runner import run_policy
from lumend.sim.workload import Workload, synthetic

MODEL, GPU = "sim-small", "h100-tp4"
FAULT_AT = 40.0
PER_WORKER = 35.0  # req/s: keeps sim-small busy


@cache
def workload(workers: int = 4) -> Workload:
    return synthetic(rate=workers * PER_WORKER, duration_s=100.0, seed=3)


def config(policy_name: str, fault: FaultKind, workers: int = 4, **kw: object) -> SimConfig:
    base = SimConfig(workers=workers, model=MODEL, gpu=GPU,
                     fault=FaultSpec(kind=fault, at_s=FAULT_AT, fraction=0.5))
    return apply_policy(replace(base, **kw), policy_name)  # type: ignore[arg-type]


def sim(policy_name: str, fault: FaultKind, workers: int = 4, **kw: object) -> SimResult:
    return simulate(workload(workers), config(policy_name, fault, workers, **kw))


@cache
def cached(policy_name: str, fault: FaultKind) -> SimResult:
    return sim(policy_name, fault)


def interrupted(result: SimResult) -> list[Req]:
    return [r for r in result.requests if r.interrupted_at >= 0]


def coverage(result: SimResult) -> float:
    """Checkpointed over resident tokens of the requests on the failed workers."""
    reqs = [r for r in result.requests if r.resident_at_fault > 0]
    return sum(r.ckpt_tokens for r in reqs) / sum(r.resident_at_fault for r in reqs)


def assert_conserved(result: SimResult) -> None:
    for r in result.requests:
        assert r.completions == 1, f"request {r.rid} completed {r.completions} times"
        assert r.arrival <= r.first_token <= r.finish
        assert r.generated == r.output


# -- defaults follow the product -------------------------------------------------------------


def test_detection_and_eviction_defaults_are_the_products() -> None:
    cfg = SimConfig()
    assert cfg.crash_detect_s == SupervisorTiming().tick_s
    assert cfg.hang_detect_s == pytest.approx(SupervisorTiming().hung_kill_after_s)
    assert cfg.host_detect_s == EtcdSection(endpoints=["http://e:2379"]).lease_ttl_s
    assert cfg.eviction == CheckpointSection().eviction
    assert set(EVICTIONS) == set(PRODUCT_EVICTIONS)


# -- conservation and determinism --------------------------------------------------------------


@pytest.mark.parametrize("policy_name", sorted(VARIANTS))
@pytest.mark.parametrize("fault", [FaultKind.worker, FaultKind.node, FaultKind.correlated,
                                   FaultKind.fraction, FaultKind.hang])
def test_every_request_completes_exactly_once(policy_name: str, fault: FaultKind) -> None:
    assert_conserved(cached(policy_name, fault))


def test_same_seed_same_numbers_with_every_mechanism_on() -> None:
    cfg = config("lumen_shadow_dual", FaultKind.fraction, budget_bytes=0.5 * GIB,
                 eviction="shortest_prefix", crash_detect_s=2.0)
    a = run_policy(workload(), cfg, "lumen_shadow_dual").metrics
    b = run_policy(workload(), cfg, "lumen_shadow_dual").metrics
    assert a == b and a.evictions > 0
    other = run_policy(workload(), replace(cfg, seed=1), "lumen_shadow_dual").metrics
    assert other != a  # negative control: the seed picks other failing workers


def test_the_kept_load_column_equals_the_policys_loads_throughout() -> None:
    checks = []

    class Checked(Simulation):
        def _sample(self, now: float, arrivals_left: bool) -> None:
            assert self.col_load == policy.loads(self.snapshot, self.pcfg), f"at {now} s"
            checks.append(now)
            super()._sample(now, arrivals_left)

    Checked(workload(), config("lumen_dual", FaultKind.node, budget_bytes=0.5 * GIB)).run()
    assert len(checks) > 15


# -- failure detection -----------------------------------------------------------------------


def test_detection_delay_shifts_recovery() -> None:
    prompt = sim("lumen", FaultKind.worker, crash_detect_s=0.0)
    late = sim("lumen", FaultKind.worker, crash_detect_s=5.0)
    assert late.fault is not None and late.fault.detected_at == FAULT_AT + 5.0
    assert min(r.replay_first for r in interrupted(late)) >= FAULT_AT + 5.0
    # Negative control: noticed at once, some streams resume within 5 s.
    assert min(r.replay_first for r in interrupted(prompt)) < FAULT_AT + 5.0

    def replay(result: SimResult) -> float:
        return mean([r.replay_first - r.interrupted_at for r in interrupted(result)])

    assert replay(late) > replay(prompt) + 4.0
    # Until detected the failed worker still looks alive: arrivals admitted to it wait and
    # are moved at detection.
    stranded = [r for r in late.requests
                if FAULT_AT < r.arrival < FAULT_AT + 5.0 and r.epoch > 0]
    assert stranded and all(r.first_token >= FAULT_AT + 5.0 for r in stranded)
    assert_conserved(late)


def test_a_lost_host_is_noticed_at_the_lease_ttl_a_crash_at_the_supervisor_tick() -> None:
    node = cached("lumen", FaultKind.node).fault
    crash = cached("lumen", FaultKind.worker).fault
    assert node is not None and crash is not None
    assert node.host_lost and not crash.host_lost
    assert node.detected_at == pytest.approx(FAULT_AT + 10.0)
    assert crash.detected_at == pytest.approx(FAULT_AT + 0.1)


def test_a_hung_engine_stalls_its_streams_until_the_kill_and_reloads_from_there() -> None:
    hang = cached("lumen", FaultKind.hang)
    crash = cached("lumen", FaultKind.worker)
    assert hang.fault is not None and crash.fault is not None
    detect = SimConfig().hang_detect_s
    assert hang.fault.detected_at == pytest.approx(FAULT_AT + detect)
    reload_s = load_cost_model(MODEL, GPU).load_time(3e9, 20.0)
    assert hang.fault.back_at == pytest.approx(FAULT_AT + detect + reload_s)
    # Its streams stop at the hang (no token from it after) and go on only once moved.
    stalled = interrupted(hang)
    assert stalled and all(r.interrupted_at == FAULT_AT for r in stalled)
    assert min(r.replay_first for r in stalled) >= FAULT_AT + detect
    # It is still admitted to while hung, until it is taken as stalled: those requests wait
    # for the kill and are moved then, but were never streams it cut off (the gateways find
    # them refused). From the stall on, arrivals go to the others.
    stall = SimConfig().hang_stall_s
    assert 0 < stall < detect
    stranded = [r for r in hang.requests
                if FAULT_AT < r.arrival < FAULT_AT + detect and r.epoch > 0]
    assert stranded and all(r.first_token >= FAULT_AT + detect for r in stranded)
    assert all(r.arrival < FAULT_AT + stall for r in stranded), "admitted though stalled"
    moved = sum(1 for r in hang.requests if r.epoch > 0)
    assert hang.fault.cut_off == moved - len(stranded)
    # Negative control: the crash is noticed at the tick, its streams resume within the
    # hang's detection time, and it is back a reload after the fault.
    assert min(r.replay_first for r in interrupted(crash)) < FAULT_AT + detect
    assert crash.fault.back_at == pytest.approx(FAULT_AT + reload_s)
    assert mean([r.first_token - r.arrival for r in hang.requests]) > mean(
        [r.first_token - r.arrival for r in crash.requests])
    assert_conserved(hang)


def test_a_stalled_worker_gets_no_arrival_and_without_the_stall_it_would() -> None:
    detect, stall = SimConfig().hang_detect_s, SimConfig().hang_stall_s
    window = (FAULT_AT + stall + 0.1, FAULT_AT + detect)

    def stranded(result: SimResult) -> tuple[int, int]:
        """Arrivals in the window, and those admitted to the hung worker (moved later)."""
        arrivals = [r for r in result.requests if window[0] < r.arrival < window[1]]
        return len(arrivals), sum(1 for r in arrivals if r.epoch > 0)

    arrived, to_hung = stranded(cached("lumen", FaultKind.hang))
    assert arrived > 0 and to_hung == 0
    # Negative control: taken as stalled only at the kill, it still gets its share.
    arrived, to_hung = stranded(sim("lumen", FaultKind.hang, hang_stall_s=detect))
    assert arrived > 0 and to_hung > 0


def test_a_hung_engines_lumend_repeats_its_last_load_to_admission() -> None:
    beats: list[tuple[float, int, int]] = []

    class Watched(Simulation):
        def _heartbeat(self, w: object, now: float, arrivals_left: bool) -> None:
            super()._heartbeat(w, now, arrivals_left)  # type: ignore[arg-type]
            if FAULT_AT - 2 < now < FAULT_AT + SimConfig().hang_detect_s:
                beats.append((now, self.col_beat[0], self.col_queue[0]))

    Watched(workload(), config("lumen", FaultKind.hang, admission_heartbeat_s=1.0)).run()
    during = [(beat, queue) for t, beat, queue in beats if t > FAULT_AT]
    before = [beat for t, beat, _ in beats if t < FAULT_AT]
    assert during and before
    assert {beat for beat, _ in during} == {before[-1]}
    # What it was given meanwhile counts in its column all the same (none finish).
    assert during[-1][1] > during[0][1] >= before[-1] - 1


# -- shadow engines ------------------------------------------------------------------------


def test_a_shadow_replaces_a_crashed_engine_in_half_a_second() -> None:
    shadow = cached("lumen_shadow", FaultKind.worker)
    assert shadow.fault is not None and shadow.fault.back_at == pytest.approx(FAULT_AT + 0.5)
    back = [r for r in shadow.requests if r.worker == 0 and r.arrival > FAULT_AT]
    assert back and min(r.first_token for r in back) < FAULT_AT + 2.0
    # In-flight requests are still lost with the engine and recovered by Algorithm 2.
    lost = interrupted(shadow)
    assert lost and any(r.resumed for r in lost) and all(r.worker != -1 for r in lost)
    # Negative control: without shadows the worker is back only after reloading its model.
    reload_s = load_cost_model(MODEL, GPU).load_time(3e9, 20.0)
    plain = cached("lumen", FaultKind.worker)
    assert plain.fault is not None and plain.fault.back_at == pytest.approx(FAULT_AT + reload_s)


def test_shadows_do_not_survive_a_lost_node() -> None:
    reload_s = load_cost_model(MODEL, GPU).load_time(3e9, 20.0)
    node = cached("lumen_shadow", FaultKind.node)
    assert node.fault is not None and node.fault.back_at == pytest.approx(FAULT_AT + reload_s)


def test_shadows_cut_the_ttft_cost_of_a_crash() -> None:
    with_shadow = run_policy(workload(), config("lumen_shadow", FaultKind.worker),
                             "lumen_shadow").metrics
    without = run_policy(workload(), config("lumen", FaultKind.worker), "lumen").metrics
    assert with_shadow.mean_ttft_s < without.mean_ttft_s
    assert with_shadow.interrupted > 0


# -- dual-replica checkpoints ----------------------------------------------------------------


def test_dual_replicas_survive_the_server_and_a_holder_failing_together() -> None:
    single = cached("lumen", FaultKind.correlated)
    dual = cached("lumen_dual", FaultKind.correlated)
    assert single.fault is not None and dual.fault is not None
    assert single.fault.host_lost and len(dual.fault.failed) == 2
    # Every interrupted request had two replicas, neither on its server.
    assert all(len(r.holders) == 2 or r.finish > 0 for r in dual.requests)
    assert coverage(dual) > 0.9
    assert coverage(single) < coverage(dual) - 0.2  # one replica dies with the holder
    assert sum(r.resumed for r in interrupted(dual)) > sum(r.resumed for r in interrupted(single))


def test_dual_replicas_cost_twice_the_checkpoint_memory() -> None:
    def held(result: SimResult) -> float:
        return sum(result.peak_held)

    assert held(cached("lumen_dual", FaultKind.worker)) > 1.6 * held(
        cached("lumen", FaultKind.worker))


# -- link contention -------------------------------------------------------------------------


def test_two_servers_streaming_into_one_holder_lose_more_checkpoint() -> None:
    # Fixed checkpointing's static neighbours: with 3 workers on 2 nodes (2 per node), workers
    # 0 and 1 both stream to worker 2; with 4 workers, 0 streams to 2 alone. A link that
    # carries one server's stream but not two.
    def cov(workers: int, link: float) -> float:
        return coverage(sim("fixed_checkpoint", FaultKind.worker, workers,
                            link_bytes_per_s=link))

    shared, alone = cov(3, 4e9), cov(4, 4e9)
    assert alone > 0.8
    assert shared < alone - 0.2
    # Negative control: a fast link makes the sharing harmless.
    assert cov(3, 100e9) > 0.95


@pytest.mark.parametrize("restore_async", [False, True])
def test_concurrent_restores_from_one_holder_share_its_bandwidth(restore_async: bool) -> None:
    # Fixed checkpointing resumes all of worker 0's requests on its neighbour (worker 2).
    bw = 1e9
    result = sim("fixed_checkpoint", FaultKind.worker, restore_bytes_per_s=bw,
                 restore_async=restore_async)
    resumed = [r for r in interrupted(result) if r.resumed]
    assert len(resumed) > 20
    kvb = load_cost_model(MODEL, GPU).model.kv_bytes_per_token
    restored = [min(r.ckpt_tokens, r.prompt + r.output) * kvb for r in resumed]
    assert result.fault is not None and result.fault.detected_at is not None
    last = max(r.replay_first for r in resumed) - result.fault.detected_at
    # Shared: the last one streams only after (nearly) all bytes went through ...
    assert last >= 0.9 * sum(restored) / bw
    # ... far later than any one transfer alone would take.
    assert last > 5 * max(restored) / bw


# -- eviction --------------------------------------------------------------------------------


@pytest.mark.parametrize("eviction", ["lru", "shortest_prefix", "longest_prefix_protected"])
def test_eviction_keeps_every_holder_within_its_budget(eviction: str) -> None:
    budget = 0.5 * GIB
    result = sim("lumen", FaultKind.worker, budget_bytes=budget, eviction=eviction)
    assert result.evictions > 0
    assert max(result.peak_held) <= budget * (1 + 1e-9)
    assert interrupted(result) and any(r.resumed for r in interrupted(result))
    assert_conserved(result)


def test_refuse_keeps_the_budget_without_evicting() -> None:
    budget = 0.5 * GIB
    refuse = sim("lumen", FaultKind.worker, budget_bytes=budget, eviction="refuse")
    assert refuse.evictions == 0 and refuse.refused > 0
    assert max(refuse.peak_held) <= budget * (1 + 1e-9)
    # Negative control: an ample budget neither evicts nor refuses.
    roomy = cached("lumen", FaultKind.worker)
    assert roomy.evictions == 0 and roomy.refused == 0


def victims_order(eviction: str) -> list[int]:
    s = Simulation(workload(), config("lumen", FaultKind.none, eviction=eviction))
    w = s.workers[1]
    # rid, held tokens, placed at
    for rid, tokens, placed in [(0, 500, 3.0), (1, 100, 2.0), (2, 900, 1.0), (3, 300, 4.0)]:
        r = Req(rid, 0.0, tokens, 10)
        r.hold_bytes, r.hold_t = float(tokens), placed
        w.held.add(r)
    return [r.rid for r in s._victims(w)]


def test_eviction_order_follows_the_holders_policies() -> None:
    assert victims_order("lru") == [2, 1, 0, 3]                 # oldest placement first
    assert victims_order("shortest_prefix") == [1, 3, 0, 2]     # shortest first
    assert victims_order("longest_prefix_protected") == [1, 3, 0]  # the longest 25% kept


def test_synchronous_restores_stall_the_holder_so_spreading_them_pays() -> None:
    def replay(policy_name: str, restore_async: bool) -> float:
        result = sim(policy_name, FaultKind.worker, restore_async=restore_async)
        return mean([r.replay_first - r.interrupted_at for r in interrupted(result)])

    # Every resume on one holder: loading inside its steps makes the replays slower.
    assert replay("fixed_checkpoint", False) > 1.2 * replay("fixed_checkpoint", True)
    # LUMEN's load-aware holders spread the loads; it beats fixed checkpointing here ...
    assert replay("lumen", False) < replay("fixed_checkpoint", False)
    # ... by more than when loads do not stall (negative control for the mechanism).
    assert (replay("fixed_checkpoint", False) - replay("lumen", False)
            > replay("fixed_checkpoint", True) - replay("lumen", True))


def test_policies_differing_only_in_recovery_share_one_reference_run() -> None:
    from lumend.sim.runner import reference_config, run_policies

    cfg = config("lumen", FaultKind.worker)
    shared = run_policies(workload(), cfg, ["lumen", "lumen_shadow"])
    alone = run_policy(workload(), cfg, "lumen_shadow").metrics
    assert shared[1].metrics == alone
    assert shared[0].metrics.baseline_mean_ttft_s == alone.baseline_mean_ttft_s

    def key(name: str) -> SimConfig:
        return reference_config(apply_policy(cfg, name))

    assert key("lumen") == key("lumen_shadow") == key("lumen-placement")
    # Placement changes the failure-free run: those keep their own.
    assert key("lumen_dual") != key("lumen") != key("fixed_checkpoint")


def test_a_reload_reads_the_weights_at_reload_gbps_or_takes_reload_s() -> None:
    slow = SimConfig(workers=4, model=MODEL, gpu=GPU, fault=FaultSpec(FaultKind.worker, FAULT_AT),
                     reload_gbps=0.5, init_s=3.0)
    done = simulate(workload(), apply_policy(slow, "stop_and_restart"))
    weights = load_cost_model(MODEL, GPU).model.weight_bytes
    assert done.fault is not None
    assert done.fault.back_at == pytest.approx(FAULT_AT + weights / 0.5e9 + 3.0)
    fixed = simulate(workload(), apply_policy(replace(slow, reload_s=7.0), "stop_and_restart"))
    assert fixed.fault is not None and fixed.fault.back_at == pytest.approx(FAULT_AT + 7.0)
    with pytest.raises(ValueError, match="reload_gbps must be positive"):
        SimConfig(reload_gbps=0)
