"""The simulator set up as the local cluster's sim engines (lumend.sim.local) computes the
same times as the sim engine's own scheduler, driven here without sleeping."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace
from typing import Any

import pytest

from lumenctl.recovery import trace
from lumend.engine.costmodel import StepCoefficients
from lumend.engine.sim_core import Scheduler, SimRequest, StepClock, StepCost, StepOutput
from lumend.engine.sim_models import sim_model
from lumend.sim.config import FaultKind, FaultSpec, apply_policy
from lumend.sim.engine import SimResult, simulate
from lumend.sim.local import local_cluster_config, sim_engine_cost
from lumend.sim.workload import Workload

SCALE = 8.0


def engine_times(requests: list[tuple[float, int, int]], scale: float = SCALE
                 ) -> list[tuple[float, float]]:
    """(first token, last token) per request from one sim engine's Scheduler, its steps
    taking step time x `scale` of virtual time, arrivals joining before the next step."""
    model = sim_model("sim-small")
    scheduler = Scheduler(0, model.cost, model.limits)
    times: list[list[float]] = [[] for _ in requests]
    now, i = 0.0, 0
    stamp = [now]  # the end of the step in progress: when its tokens are out
    while i < len(requests) or not scheduler.idle():
        if scheduler.idle():
            now = max(now, requests[i][0])
        while i < len(requests) and requests[i][0] <= now:
            _, prompt, output = requests[i]

            def emit(out: StepOutput | None, k: int = i) -> None:
                times[k].append(stamp[0])
            scheduler.add(SimRequest(str(i), [65] * prompt, output, emit))
            i += 1
        duration, decoding = scheduler.begin_step()
        now += duration * scale
        stamp[0] = now
        scheduler.end_step(decoding)
    return [(t[0], t[-1]) for t in times]


def simulated(requests: list[tuple[float, int, int]], **changes: Any) -> SimResult:
    """`requests` through the simulator set up as one sim-small engine (no fault), with
    `changes` to its SimConfig (a rule to compare, or `request_overhead_s`)."""
    cfg = local_cluster_config("sim-small", SCALE, 1, fault_at_s=0.0,
                               restore_bytes_per_s=5e8, process_start_s=1.0)
    cfg = replace(cfg, fault=FaultSpec(kind=FaultKind.none), **changes)
    workload = Workload(*(list(column) for column in zip(*requests, strict=True)))
    return simulate(workload, apply_policy(cfg, "stop_and_restart"))


def simulator_times(requests: list[tuple[float, int, int]]) -> list[tuple[float, float]]:
    return [(r.first_token, r.finish) for r in simulated(requests).requests]


def test_the_sim_engine_steps_with_the_simulators_formula() -> None:
    # One class, so the two cannot drift apart: the engine's step cost is the cost model's.
    assert StepCost is StepCoefficients
    model = sim_model("sim-small")
    cost = sim_engine_cost(model, SCALE)
    scheduler = Scheduler(0, model.cost, model.limits)
    scheduler.add(SimRequest("a", [65] * 700, 4, lambda _: None))
    duration, _ = scheduler.begin_step()
    assert duration * SCALE == pytest.approx(cost.step_time(512, 0, 0), rel=1e-12)
    assert cost.coefficients.a == pytest.approx(model.cost.a * SCALE, rel=1e-12)


def test_one_request_takes_the_same_time_in_the_engine_and_the_simulator() -> None:
    engine = engine_times([(0.0, 1100, 40)])
    times = simulator_times([(0.0, 1100, 40)])
    (e_first, e_last), (s_first, s_last) = engine[0], times[0]
    # The step that runs a prompt's last chunk is charged as the engine charges it: one
    # decoding sequence more (`prefill_end_decodes`). Without it the first token came
    # 0.2 ms x scale early per prompt.
    assert s_first == pytest.approx(e_first, abs=1e-9)
    assert s_last == pytest.approx(e_last, abs=1e-9)
    plain = simulated([(0.0, 1100, 40)], prefill_end_decodes=False)
    assert plain.requests[0].first_token < e_first - 1e-4  # negative control


def test_a_trace_on_one_engine_gives_the_same_first_and_last_tokens() -> None:
    requests = [(r.at, len(r.prompt), r.max_tokens)
                for r in trace(3, 20.0, 2.0, (300, 1400), (20, 80))]
    assert len(requests) > 20
    engine = engine_times(requests)
    times = simulator_times(requests)
    for (e_first, e_last), (s_first, s_last) in zip(engine, times, strict=True):
        assert s_first == pytest.approx(e_first, abs=1e-9)
        assert s_last == pytest.approx(e_last, abs=1e-9)


def test_counting_decode_tokens_against_the_budget_is_not_the_sim_engine() -> None:
    # Negative control: vLLM's budget (decode tokens count against it) on a batch of
    # long decodes delays a later prompt's prefill chunks; the sim engine's does not.
    # (Arrivals 1 ms apart: of requests arriving at one instant the engine takes all into
    # its first step, the simulator starts that step with the first.)
    requests = [(0.001 * i, 100, 400) for i in range(60)] + [(1.0, 2000, 4)]
    engine = engine_times(requests)[-1][0] - 1.0
    for decode_in_budget, agrees in ((False, True), (True, False)):
        last = simulated(requests, decode_in_budget=decode_in_budget).requests[-1]
        ttft = last.first_token - last.arrival
        assert (ttft == pytest.approx(engine, rel=0.02)) is agrees


def test_under_overload_a_prompt_starts_when_the_engine_would_admit_it() -> None:
    # 150 requests at ~2.5x one engine's capacity: the KV pool is full most of the time.
    # The sim engine admits a prompt once all of its blocks (and one more) are free, and an
    # admitted prompt's unprefilled rest counts as used; the simulator counting only the
    # tokens already prefilled started prompts in the space the engine keeps for them
    # (mean TTFT 4.5% early on this trace). Now 0.2% (27 of 150 requests differ, by up to
    # three steps). vLLM's rule, the negative control, preempts and is far off.
    rng = random.Random(3)
    requests = sorted((round(rng.uniform(0, 60), 3), rng.randint(600, 1400),
                       rng.randint(100, 200)) for _ in range(150))
    engine = engine_times(requests)
    engine_ttft = statistics.fmean(
        first - sent for (first, _), (sent, _, _) in zip(engine, requests, strict=True))
    for kv_preemption, agrees in ((False, True), (True, False)):
        result = simulated(requests, kv_preemption=kv_preemption)
        ttft = statistics.fmean(r.first_token - r.arrival for r in result.requests)
        assert (ttft == pytest.approx(engine_ttft, rel=0.01)) is agrees


def test_the_trace_is_seeded() -> None:
    assert trace(7, 30.0, 3.0, (600, 1400), (100, 200)) == trace(
        7, 30.0, 3.0, (600, 1400), (100, 200))
    assert trace(7, 30.0, 3.0, (600, 1400), (100, 200)) != trace(
        8, 30.0, 3.0, (600, 1400), (100, 200))


def test_the_local_cluster_config_is_the_sim_engines() -> None:
    model = sim_model("sim-small")
    cfg = local_cluster_config("sim-small", 4.0, 4, fault_at_s=30.0,
                               restore_bytes_per_s=5e8, process_start_s=1.5)
    assert cfg.chunk_tokens == model.limits.prefill_chunk
    assert cfg.max_batch == model.limits.max_batch
    assert cfg.kv_capacity_tokens == model.limits.kv_blocks * 16
    assert cfg.reload_s == pytest.approx(1.5 + model.init_s * 4.0)
    assert cfg.cluster_cost().model.kv_bytes_per_token == model.kv_bytes_per_token
    assert cfg.fault.kind is FaultKind.worker and cfg.fault.at_s == 30.0
    with pytest.raises(ValueError, match="time scale"):
        sim_engine_cost(model, 0.0)


def test_the_step_clock_keeps_the_engines_own_work_inside_the_modelled_step() -> None:
    clock = StepClock()
    assert clock.begin(10.0, 0.1) == pytest.approx(0.1)  # from idle: starts now
    # 20 ms of the engine's own work after the step: the next one still ends at 10.2.
    assert clock.begin(10.12, 0.1) == pytest.approx(0.08)
    assert clock.end == pytest.approx(10.2)
    assert clock.late_s == 0.0
    # More than a step behind: the clock restarts from now and counts what it gave up.
    assert clock.begin(10.5, 0.1) == 0.0
    assert clock.end == pytest.approx(10.5)
    assert clock.late_s == pytest.approx(0.2)
    assert clock.modelled_s == pytest.approx(0.3)
    clock.idle()  # no work: the next step starts when it is asked for
    assert clock.begin(20.0, 0.1) == pytest.approx(0.1)
    assert clock.late_s == pytest.approx(0.2)
    # Woken 15 ms past the step's end: its tokens go out late (an overrun), the next step
    # still ends on schedule and nothing is given up.
    assert clock.overrun_s == 0.0
    clock.ended(20.115)
    assert clock.overrun_s == pytest.approx(0.015)
    assert clock.begin(20.116, 0.1) == pytest.approx(0.084)
    clock.ended(20.2)  # on time
    assert clock.overrun_s == pytest.approx(0.015) and clock.late_s == pytest.approx(0.2)


def test_the_serving_overhead_delays_each_request_before_the_scheduler() -> None:
    requests = [(0.0, 1100, 40), (5.0, 700, 10)]
    plain = simulator_times(requests)
    result = simulated(requests, request_overhead_s=0.05)
    for r, (first, last) in zip(result.requests, plain, strict=True):
        assert r.first_token == pytest.approx(first + 0.05)
        assert r.finish == pytest.approx(last + 0.05)
    with pytest.raises(ValueError, match="request_overhead_s"):
        simulated(requests, request_overhead_s=-1.0)


def test_under_kv_pressure_the_simulator_follows_the_engines_kv_rule() -> None:
    # 40 requests of 1400 + 600 tokens at once: 80 000 tokens of context on a 65 536-token
    # pool. The sim engine admits a prompt that fits and lets running sequences grow past
    # the pool; vLLM's rule (negative control) preempts and recomputes, and takes longer.
    requests = [(0.01 * i, 1400, 600) for i in range(40)]
    engine = engine_times(requests)
    engine_mean = sum(last for _, last in engine) / len(engine)
    for kv_preemption, agrees in ((False, True), (True, False)):
        result = simulated(requests, kv_preemption=kv_preemption)
        mean = sum(r.finish for r in result.requests) / len(result.requests)
        assert (mean == pytest.approx(engine_mean, rel=0.02)) is agrees
        assert (result.preemptions == 0) is agrees


def test_the_fault_hits_the_named_worker_and_counts_every_stream_it_cut_off() -> None:
    # 21 requests that all run past the fault on two workers: admission alternates and
    # breaks the ties by index, so worker 0 holds 11 and worker 1 holds 10. The last one
    # arrives just before the fault and has no first token yet: the gateway still sees its
    # stream break, and it counts.
    requests = [(0.01 * i, 1000, 400) for i in range(20)] + [(3.99, 1400, 400)]
    workload = Workload(*(list(column) for column in zip(*requests, strict=True)))
    held = {}
    for victim in (0, 1):
        cfg = local_cluster_config("sim-small", SCALE, 2, fault_at_s=4.0,
                                   restore_bytes_per_s=5e8, process_start_s=1.0,
                                   victim=victim)
        result = simulate(workload, apply_policy(cfg, "stop_and_restart"))
        assert result.fault is not None and result.fault.failed == [victim]
        with_token = sum(r.interrupted_at >= 0 for r in result.requests)
        held[victim] = result.fault.cut_off
        assert result.fault.cut_off == with_token + (victim == 0)
    assert held == {0: 11, 1: 10}
    with pytest.raises(ValueError, match="fault worker must be an index >= 0, got -1"):
        FaultSpec(kind=FaultKind.worker, worker=-1)
    with pytest.raises(ValueError, match="fault worker 2 is not one of the 2 workers"):
        local_cluster_config("sim-small", SCALE, 2, fault_at_s=2.0, restore_bytes_per_s=5e8,
                             process_start_s=1.0, victim=2)


def test_admission_reads_each_workers_queue_as_its_heartbeat_left_it() -> None:
    """The coordinator's admission column is max(the worker's running + waiting at its last
    heartbeat, the requests admitted and not finished): a worker whose requests finished
    since its heartbeat still looks as loaded until the next one. A runs long on worker 0;
    B runs on worker 1 through its heartbeat at 4 s and ends at ~5.4 s; two requests
    arrive at 5.6 s, before worker 1's next heartbeat at 8 s. On exact counts (the
    negative control) the first goes to worker 1, which is empty; with heartbeats worker 1
    still reports B, the two tie and the first goes to worker 0."""
    def workers_of_the_burst(heartbeat_s: float) -> list[int]:
        cfg = local_cluster_config("sim-small", SCALE, 2, fault_at_s=0.0,
                                   restore_bytes_per_s=5e8, process_start_s=1.0,
                                   heartbeat_s=heartbeat_s)
        cfg = replace(cfg, fault=FaultSpec(kind=FaultKind.none))
        requests = [(0.0, 100, 3000), (0.01, 100, 165), (5.6, 100, 50), (5.61, 100, 50)]
        result = simulate(Workload(*(list(c) for c in zip(*requests, strict=True))),
                          apply_policy(cfg, "stop_and_restart"))
        a, b, *burst = result.requests
        assert (a.worker, b.worker) == (0, 1)
        assert 4.0 < b.finish < 5.6, b.finish  # through worker 1's heartbeat, not the next
        return [r.worker for r in burst]

    assert workers_of_the_burst(0.0) == [1, 0]
    assert workers_of_the_burst(4.0) == [0, 1]
    with pytest.raises(ValueError, match="admission_heartbeat_s"):
        simulated([(0.0, 100, 10)], admission_heartbeat_s=-1.0)


def test_the_heartbeats_phases_and_the_coordinators_read_decide_a_tie() -> None:
    """The setting of the test above (heartbeats every 4 s; B on worker 1 ends at ~5.4 s,
    the burst comes at 5.6 s) under other phases. Worker 1 reporting at 5.5 s (phase
    0.375), after B ended: the burst's first goes to it. The default phases with the
    coordinator reading the heartbeats at 3.6 s and 7.6 s (read phase 0.9): worker 1's
    report of B at 4 s is not read before the burst, which again goes first to worker 1;
    read at once (the default, the negative control), the two tie and it goes to worker 0."""
    def workers_of_the_burst(**phases: Any) -> list[int]:
        cfg = local_cluster_config("sim-small", SCALE, 2, fault_at_s=0.0,
                                   restore_bytes_per_s=5e8, process_start_s=1.0,
                                   heartbeat_s=4.0)
        cfg = replace(cfg, fault=FaultSpec(kind=FaultKind.none), **phases)
        requests = [(0.0, 100, 3000), (0.01, 100, 165), (5.6, 100, 50), (5.61, 100, 50)]
        result = simulate(Workload(*(list(c) for c in zip(*requests, strict=True))),
                          apply_policy(cfg, "stop_and_restart"))
        a, b, *burst = result.requests
        assert (a.worker, b.worker) == (0, 1)
        assert 4.0 < b.finish < 5.5, b.finish
        return [r.worker for r in burst]

    assert workers_of_the_burst() == [0, 1]
    assert workers_of_the_burst(admission_heartbeat_phases=(0.5, 0.375)) == [1, 0]
    assert workers_of_the_burst(admission_read_phase=0.9) == [1, 0]
    assert workers_of_the_burst(admission_heartbeat_phases=(0.5, 0.99),
                                admission_read_phase=0.0) == [0, 1]
    for bad in ({"admission_heartbeat_phases": (0.5, 0.5)},  # one worker, two phases
                {"admission_heartbeat_phases": (1.0,)},
                {"admission_read_phase": -0.1}):
        with pytest.raises(ValueError, match="admission_"):
            simulated([(0.0, 100, 10)], admission_heartbeat_s=1.0, **bad)


def test_requests_a_hung_engine_never_read_reach_the_survivor_before_its_broken_streams(
) -> None:
    """At a hung engine's kill the gateways find the requests admitted to it since the hang
    refused and admit them again a few milliseconds before the broken streams' recoveries
    arrive (the validation's real runs: their first tokens came first on the survivor). B
    (2000-token prompt) runs on worker 1 when it hangs at 1 s; C (100 tokens) is admitted to
    it at 1.5 s (worker 0 has two requests, and no stall); at the kill both recompute on
    worker 0, C first: its first token comes before B's first one after the kill, which
    would come first the other way round (B's 2000-token prefill ahead of C's)."""
    cfg = local_cluster_config("sim-small", SCALE, 2, fault_at_s=1.0, restore_bytes_per_s=5e8,
                               process_start_s=1.0, fault_kind=FaultKind.hang, victim=1)
    cfg = replace(cfg, hang_stall_s=cfg.hang_detect_s)
    requests = [(0.0, 100, 3000), (0.01, 2000, 200), (0.02, 100, 3000), (1.5, 100, 20)]
    result = simulate(Workload(*(list(c) for c in zip(*requests, strict=True))),
                      apply_policy(cfg, "stop_and_restart"))
    a1, b, a2, c = result.requests
    assert (a1.admitted_to, b.admitted_to, a2.admitted_to, c.admitted_to) == (0, 1, 0, 1)
    assert b.interrupted_at >= 0 and c.interrupted_at < 0  # C was never read: not cut off
    killed = 1.0 + cfg.hang_detect_s
    assert killed < c.first_token < b.replay_first, (c.first_token, b.replay_first)
