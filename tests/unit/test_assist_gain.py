"""Draft-assist by predicted gain in the live coordinator (issue 15): the engines' step
counters in the worker's load, the coordinator's recent step time from their growth, the
gain's inputs, and the survivor `assist_ops` picks with them (and without them)."""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterator

import pytest
from msgspec.structs import replace

from lumenctl.localcluster import stop_process
from lumend.cluster.models import (
    AssistAssignment,
    AssistEstimates,
    EngineInfo,
    WorkerLoad,
    WorkerRecord,
    decode_value,
)
from lumend.cluster.store import Delete, Op, Put
from lumend.cluster.view import ClusterView
from lumend.coordinator.estimates import (
    ASSIST_PRIOR_AGREEMENT,
    ASSIST_ROUND_S,
    MIN_DRAFTED,
    MIN_STEPS,
    StepTracker,
    assist_inputs,
    draft_tokens,
    tokens_per_round,
)
from lumend.coordinator.policy import assist_gain
from lumend.coordinator.service import CoordinatorService
from lumend.engine.adapter import parse_load

from ..assist.test_assignments import KEYS, assisting, decided, events, puts, view
from .test_gateway_checkpoints import worker
from .test_sim_openai import Engine, start_engine, wait_active

# -- the counters in the worker's load --------------------------------------------------


VLLM_TEXT = """\
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:inter_token_latency_seconds_bucket{model_name="m",engine="0",le="0.01"} 10.0
vllm:inter_token_latency_seconds_count{model_name="m",engine="0"} 400.0
vllm:inter_token_latency_seconds_sum{model_name="m",engine="0"} 6.0
lumen_sim_steps_total 7
lumen_sim_step_seconds_total 0.5
"""


def test_parse_load_reads_vllm_inter_token_latency_else_the_sim_steps() -> None:
    load = parse_load(VLLM_TEXT)
    assert (load.step_s, load.steps) == (6.0, 400)  # vLLM's pair, never mixed
    sim = parse_load("lumen_sim_steps_total 7\nlumen_sim_step_seconds_total 0.5\n")
    assert (sim.step_s, sim.steps) == (0.5, 7)
    half = parse_load("vllm:inter_token_latency_seconds_sum 6.0\nlumen_sim_steps_total 7\n")
    assert (half.step_s, half.steps) == (None, None)  # no complete pair: not exported
    none = parse_load('vllm:num_requests_running{model_name="m"} 1\n')
    assert (none.step_s, none.steps) == (None, None)
    assert none.report().step_s is None and none.report().steps is None


@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    engine = start_engine(tmp_path_factory.mktemp("assist-gain"), "gain")
    try:
        wait_active(engine)
        yield engine
    finally:
        stop_process(engine.proc)


def test_a_sim_engine_exports_its_steps_and_computed_prompt_tokens(sim_engine: Engine
                                                                   ) -> None:
    def scrape() -> str:
        with urllib.request.urlopen(sim_engine.url + "/metrics", timeout=10) as r:
            return str(r.read().decode())

    before = parse_load(scrape())
    prompt = "a prompt of some length for the step counters"
    n_prompt = len(sim_engine.tokens(prompt))
    sim_engine.ok("/v1/completions", {"prompt": prompt, "max_tokens": 20})
    text = scrape()
    after = parse_load(text)
    assert before.steps is not None and after.steps is not None
    assert before.step_s is not None and after.step_s is not None
    assert before.prefill_tokens is not None and after.prefill_tokens is not None
    # One step per token (one prefill chunk yields the first), each a modelled step.
    assert after.steps - before.steps == 20
    assert after.step_s > before.step_s
    assert after.prefill_tokens - before.prefill_tokens == n_prompt
    metric = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
              for line in text.splitlines() if line and not line.startswith("#")}
    assert after.prefill_tokens == metric["lumen_sim_prefill_tokens_total"]
    # Its prefill time, as vLLM's request_prefill_time_seconds (tests/unit/
    # test_sim_prefill_time.py checks it against the cost model).
    assert after.prefill_s is not None and before.prefill_s is not None
    assert after.prefill_s > before.prefill_s


# -- the recent step time -------------------------------------------------------------


def rec(name: str, at: float, steps: int | None, step_s: float | None, *, running: int = 4,
        waiting: int = 0, kv: float = 0.5, prefill: int | None = None, engine: str = "0",
        node: str = "n1") -> WorkerRecord:
    w = worker(name, node, running=running)
    return replace(w, updated_at=at,
                   engines=[EngineInfo(id=f"{name}/{engine}", role="active", state="active",
                                       url=f"http://{name}:1")],
                   load=WorkerLoad(running=running, waiting=waiting, kv_usage=kv,
                                   steps=steps, step_s=step_s, prefill_tokens=prefill))


def test_step_time_from_the_counters_growth_not_their_lifetime_ratio() -> None:
    t = StepTracker()
    t.observe([rec("a", 0.0, 10_000, 50.0, prefill=1_000_000)])  # 5 ms a step so far
    assert t.rate("a") is None  # one record: no growth yet
    t.observe([rec("a", 10.0, 12_000, 90.0, prefill=1_100_000)])  # the last 2000: 20 ms
    r = t.rate("a")
    assert r is not None
    assert math.isclose(r.step_s, 0.02) and r.steps == 2000 and r.span_s == 10.0
    assert r.prefill_tokens == 100_000
    t.observe([rec("a", 10.0, 12_000, 90.0)])  # the same record again: no new sample
    assert t.rate("a") == r


def test_a_month_old_engines_counters_still_give_the_recent_step_time() -> None:
    # A month of steps at 2 ms, then 20 ms in the last 10 s (the counters are exact: this
    # growth is 1/260000 of their total, inside any rounding relative to it).
    t = StepTracker()
    steps, seconds = 1_300_000_000, 2_600_000.0
    t.observe([rec("a", 0.0, steps, seconds, prefill=10**10)])
    t.observe([rec("a", 10.0, steps + 500, seconds + 10.0, prefill=10**10 + 2048)])
    r = t.rate("a")
    assert r is not None and math.isclose(r.step_s, 0.02) and r.steps == 500
    assert r.prefill_tokens == 2048 and r.span_s == 10.0


def test_too_short_a_span_or_too_few_steps_is_no_step_time() -> None:
    t = StepTracker()
    t.observe([rec("a", 0.0, 10_000, 50.0)])
    t.observe([rec("a", 1.0, 10_100, 52.0)])  # 1 s: under MIN_STEP_SPAN_S
    assert t.rate("a") is None
    t.observe([rec("a", 5.0, 10_110, 52.5)])  # the first pair has 110 steps over 5 s
    r = t.rate("a")
    assert r is not None and r.steps == 110 and r.span_s == 5.0
    t2 = StepTracker()
    t2.observe([rec("b", 0.0, 10_000, 50.0)])
    t2.observe([rec("b", 10.0, 10_000 + MIN_STEPS - 1, 51.0)])  # an idle engine's few
    assert t2.rate("b") is None
    t2.observe([rec("b", 20.0, 10_000 + MIN_STEPS, 51.2)])
    assert t2.rate("b") is not None


def test_a_restarted_engine_starts_its_window_anew() -> None:
    t = StepTracker()
    t.observe([rec("a", 0.0, 10_000, 50.0)])
    t.observe([rec("a", 10.0, 12_000, 60.0)])
    assert t.rate("a") is not None
    t.observe([rec("a", 20.0, 100, 1.0)])  # counters back near 0: restarted
    assert t.rate("a") is None  # not a negative growth, no growth at all
    t.observe([rec("a", 30.0, 1100, 31.0)])
    r = t.rate("a")
    assert r is not None and math.isclose(r.step_s, 0.03) and r.steps == 1000
    # Another active engine (a shadow took over) with larger counters: anew as well.
    t.observe([rec("a", 40.0, 90_000, 900.0, engine="1")])
    assert t.rate("a") is None


def test_missing_counters_mean_no_step_time_and_old_samples_leave_the_window() -> None:
    t = StepTracker(window_s=60.0)
    t.observe([rec("a", 0.0, 10_000, 50.0)])
    t.observe([rec("a", 10.0, None, None)])  # its engine exports none (or no longer)
    assert t.rate("a") is None
    t.observe([rec("a", 20.0, 10_000, 50.0)])
    t.observe([rec("a", 100.0, 20_000, 150.0)])  # the first is 80 s old: out of the window
    assert t.rate("a") is None
    t.observe([])  # the worker left
    t.observe([rec("a", 110.0, 30_000, 250.0)])
    assert t.rate("a") is None


# -- the gain's inputs ----------------------------------------------------------------


def test_tokens_per_round_from_the_measured_acceptance_else_the_prior() -> None:
    k = draft_tokens("sim")
    prior = sum(ASSIST_PRIOR_AGREEMENT ** i for i in range(k + 1))
    assert math.isclose(tokens_per_round(k), prior)
    assert math.isclose(tokens_per_round(k, MIN_DRAFTED - 1, MIN_DRAFTED - 1), prior)
    assert math.isclose(tokens_per_round(k, 400, 100), 1 + k * 0.25)
    assert draft_tokens("vllm") == 3 and draft_tokens("sim") == 4


def test_assist_inputs_model_the_verify_cost_and_the_prefill() -> None:
    t = StepTracker()
    t.observe([rec("a", 0.0, 10_000, 50.0, prefill=1_000_000)])
    t.observe([rec("a", 10.0, 12_000, 70.0, prefill=1_020_000)])
    rate = t.rate("a")
    load = WorkerLoad(running=8, waiting=0, kv_usage=0.5)
    x = assist_inputs(load, rate, 4, 2.0, 1e-4)
    assert x is not None
    assert math.isclose(x.step_s, 0.01)
    assert math.isclose(x.verify_extra_s, 8 * 4 * 1e-4 + ASSIST_ROUND_S)
    assert math.isclose(x.prefill_share, 20_000 * 1e-4 / 10.0)  # 0.2 of the window
    assert not x.prefill_waiting and not x.capacity_bound
    assert math.isclose(x.gain, assist_gain(0.01, x.verify_extra_s, 2.0, False, False, 0.2))
    waiting = assist_inputs(replace(load, waiting=3), rate, 4, 2.0, 1e-4)
    assert waiting is not None and waiting.prefill_waiting and waiting.gain < 0
    full = assist_inputs(replace(load, waiting=3, kv_usage=0.95), rate, 4, 2.0, 1e-4)
    assert full is not None and full.capacity_bound and full.gain > 0
    assert assist_inputs(load, None, 4, 2.0, 1e-4) is None  # running, no step time
    idle = assist_inputs(WorkerLoad(), None, 4, 2.0, 1e-4)  # nothing to speed up
    assert idle is not None and idle.gain == 0.0


# -- the coordinator's choice ---------------------------------------------------------


def survivors(at: float, grown: bool, *, a_waiting: int = 0, steps: bool = True
              ) -> list[WorkerRecord]:
    """a: 4 running, 10 ms steps; b: the most loaded, 40 running and 6 waiting (its prefill
    waits, so verifying drafts only delays it). `grown`: the counters after 10 s."""
    n = 2000 if grown else 0

    def counters(step: float) -> tuple[int | None, float | None]:
        return (10_000 + n, 100.0 + n * step) if steps else (None, None)

    a_steps, a_s = counters(0.010)
    b_steps, b_s = counters(0.030)
    return [rec("a", at, a_steps, a_s, running=4, waiting=a_waiting, node="n1"),
            rec("b", at, b_steps, b_s, running=40, waiting=6, kv=0.6, node="n2")]


def decide(c: CoordinatorService, *, a_waiting: int = 0, steps: bool = True
           ) -> tuple[str | None, list[str]]:
    """Two views 10 s apart; the survivor the second one's decision picks, and the
    events' messages."""
    assert decided(c.assist_ops(view(*survivors(0.0, False, a_waiting=a_waiting,
                                                steps=steps)), KEYS, now=0.0)) == []
    ops = c.assist_ops(view(*survivors(10.0, True, a_waiting=a_waiting, steps=steps),
                            assisting("r", "n3")), KEYS, now=10.0)
    got = puts(ops)
    return (got["r"].survivor if "r" in got else None), [e.message for e in events(ops)]


def test_the_survivor_with_the_highest_positive_gain_is_chosen_not_the_most_loaded() -> None:
    survivor, messages = decide(CoordinatorService("n1", 7, lambda: None))
    assert survivor == "a"
    (message,) = messages
    assert "predicted gain +" in message and "the highest" in message


def test_no_assignment_while_every_gain_is_not_positive() -> None:
    c = CoordinatorService("n1", 7, lambda: None)
    survivor, messages = decide(c, a_waiting=2)  # prefill waits on a as well
    assert survivor is None and messages == []
    assert c.decisions["assist"] == 0


def test_without_step_costs_the_most_loaded_is_chosen() -> None:
    survivor, messages = decide(CoordinatorService("n1", 7, lambda: None), steps=False)
    assert survivor == "b"  # the same loads: Algorithm 3 as published
    (message,) = messages
    assert "the most loaded; L_hat, no step costs for a, b" in message


# -- an assignment judged on its own steps ----------------------------------------------


def assisted_view(at: float, a_steps: int, a_s: float, assignment: AssistAssignment | None,
                  drafter: bool = True) -> ClusterView:
    """Survivor a (4 running) with its step counters at `at`, b (its prefill waits: never
    a gain) and the drafter r (unless not `drafter`), under `assignment` if any."""
    workers = [rec("a", at, a_steps, a_s, running=4, node="n1"),
               rec("b", at, 10_000 + 200 * int(at), 100.0 + 6 * at, running=40, waiting=6,
                   kv=0.6, node="n2")]  # 30 ms a step
    if drafter:
        workers.append(assisting("r", "n3"))
    return view(*workers, assists=None if assignment is None else {"r": assignment})


def assign_a(c: CoordinatorService) -> AssistAssignment:
    """Two views 10 s apart with a at 10 ms a step: r is assigned to a."""
    assert decided(c.assist_ops(assisted_view(0.0, 10_000, 100.0, None, drafter=False),
                                KEYS, now=0.0)) == []
    got = puts(c.assist_ops(assisted_view(10.0, 12_000, 120.0, None), KEYS, now=10.0))
    assert got["r"].survivor == "a"
    assert math.isclose(got["r"].step_s_before, 0.010)  # what it is judged against
    return got["r"]


def judged(c: CoordinatorService, a: AssistAssignment, step: float, accepted: int,
           at: float = 40.0) -> tuple[list[Op], AssistAssignment]:
    """a takes 2000 steps of `step` s between 20 and `at` with r's drafts, 400 drafted
    and `accepted` of them accepted: the ops of the cycle at `at`."""
    a = replace(a, drafted_tokens=400, accepted_tokens=accepted)
    c.assist_ops(assisted_view(20.0, 14_000, 140.0, a), KEYS, now=20.0)
    ops = c.assist_ops(assisted_view(at, 16_000, 140.0 + 2000 * step, a), KEYS, now=at)
    return ops, a


def test_an_assignment_that_slows_its_survivor_ends_and_the_pair_is_benched() -> None:
    c = CoordinatorService("n1", 7, lambda: None)
    a = assign_a(c)
    # 30 ms a step with the drafts (10 before), 10 % of them accepted: 1.4 tokens a round
    # for 3x the step: the measured gain is 1.4 / 3 - 1 = -0.53.
    ops, _ = judged(c, a, 0.030, 40)
    assert any(isinstance(op, Delete) and op.key == KEYS.assist("r") for op in ops)
    (ended,) = [e for e in events(ops) if e.kind == "assist_ended"]
    assert "it hurts: measured gain -0.53" in ended.message
    assert "not paired again for 30 s" in ended.message
    assert "r" not in puts(ops)  # b's prefill waits: no other survivor gains either
    assert c.decisions["assist_hurt"] == 1
    # Benched: a's steps are back to 10 ms, yet r is not given a again before 30 s...
    v = assisted_view(60.0, 18_000, 140.0 + 2000 * 0.030 + 2000 * 0.010, None)
    assert "r" not in puts(c.assist_ops(v, KEYS, now=60.0))
    # ...and is after them, to be judged again (a second hurt benches it for 60 s).
    v = assisted_view(75.0, 20_000, 140.0 + 2000 * 0.030 + 4000 * 0.010, None)
    again = puts(c.assist_ops(v, KEYS, now=75.0))
    assert again["r"].survivor == "a"


def test_an_assignment_that_speeds_its_survivor_up_is_kept() -> None:
    # The negative control: 11 ms a step with the drafts, half of them accepted (3 tokens
    # a round for 1.1x the step: +1.7).
    c = CoordinatorService("n1", 7, lambda: None)
    ops, _ = judged(c, assign_a(c), 0.011, 200)
    assert not [op for op in ops if isinstance(op, Delete)]
    assert not events(ops) and c.decisions["assist_hurt"] == 0


def test_too_few_drafts_or_no_step_before_are_not_judged() -> None:
    c = CoordinatorService("n1", 7, lambda: None)
    a = assign_a(c)
    c.assist_ops(assisted_view(20.0, 14_000, 140.0, a), KEYS, now=20.0)
    slow = assisted_view(40.0, 16_000, 200.0, a)  # 30 ms a step, but nothing drafted yet
    assert not [op for op in c.assist_ops(slow, KEYS, now=40.0) if isinstance(op, Delete)]
    unmeasured = replace(a, drafted_tokens=400, accepted_tokens=0, step_s_before=0.0)
    v = assisted_view(60.0, 18_000, 260.0, unmeasured)  # an assignment made by L_hat
    assert not [op for op in c.assist_ops(v, KEYS, now=60.0) if isinstance(op, Delete)]


# -- what `lumenctl config show` lists ---------------------------------------------------


def published(ops: list[Op]) -> AssistEstimates | None:
    found = [decode_value(op.value, AssistEstimates) for op in ops
             if isinstance(op, Put) and op.key == KEYS.assist_estimates]
    assert len(found) <= 1
    return found[0] if found else None


def test_the_step_estimates_are_published_when_they_change_and_refreshed() -> None:
    c = CoordinatorService("n1", 7, lambda: None)
    first = published(c.assist_ops(view(*survivors(0.0, False)), KEYS, now=0.0))
    assert first is not None and first.epoch == 7 and first.at == 0.0
    assert [(r.worker, r.step_s, r.gain) for r in first.workers] == [
        ("a", None, None), ("b", None, None)]  # one record each: no growth yet
    assert "no recent step time" in first.workers[0].inputs
    grown = published(c.assist_ops(view(*survivors(10.0, True)), KEYS, now=10.0))
    assert grown is not None
    a, b = grown.workers
    assert (a.worker, a.step_s, b.step_s) == ("a", 0.01, 0.03)
    assert a.gain is not None and a.gain > 0 and b.gain is not None and b.gain < 0
    assert a.verify_extra_s is not None and "step 10 ms" in a.inputs
    # The same figures again: nothing written until the refresh, then written as they are.
    same = [replace(w, updated_at=20.0) for w in survivors(10.0, True)]
    assert published(c.assist_ops(view(*same), KEYS, now=20.0)) is None
    refreshed = published(c.assist_ops(view(*same), KEYS, now=41.0))
    assert refreshed is not None and refreshed.workers == grown.workers and refreshed.at == 41
