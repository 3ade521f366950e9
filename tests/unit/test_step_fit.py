"""The marginal cost of a prompt token, fitted from an engine's steps (lumend.engine.step_fit):
the solve on steps of a known cost, what leaves it undetermined, the timer that times a
scheduler's steps, the sums through metrics and the worker's record, the coordinator's
estimate, and a real sim engine under concurrent prompts (where vLLM's per-request prefill
time overstates the marginal cost)."""

from __future__ import annotations

import math
import random
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from msgspec.structs import replace

from lumenctl.localcluster import stop_process
from lumend.cluster.models import WorkerLoad
from lumend.coordinator.estimates import estimate
from lumend.engine.adapter import EngineLoad, parse_load
from lumend.engine.sim_models import sim_model
from lumend.engine.step_fit import (
    MIN_FIT_STEPS,
    StepFitSums,
    StepTimer,
    parse_sums,
    solve,
)

from .test_cost_estimates import worker
from .test_sim_openai import Engine, start_engine, wait_active

BASE, PER_TOKEN, PER_SEQUENCE = 0.004, 2e-5, 1e-4


def steps(n: int, rng: random.Random, noise: float = 0.0) -> StepFitSums:
    sums = StepFitSums()
    for _ in range(n):
        p = rng.choice((0, 0, 0, rng.randint(1, 512)))  # most steps decode only
        b = rng.randint(1, 64)
        y = BASE + PER_TOKEN * p + PER_SEQUENCE * b
        sums.observe(y * (1 + rng.uniform(-noise, noise)), p, b)
    return sums


def test_the_fit_recovers_a_known_step_cost() -> None:
    fit = solve(steps(2000, random.Random(1)))
    assert fit is not None and fit.steps == 2000
    assert math.isclose(fit.per_token_s, PER_TOKEN, rel_tol=1e-6)
    assert math.isclose(fit.per_sequence_s, PER_SEQUENCE, rel_tol=1e-6)
    assert math.isclose(fit.base_s, BASE, rel_tol=1e-6)
    noisy = solve(steps(2000, random.Random(2), noise=0.2))
    assert noisy is not None and math.isclose(noisy.per_token_s, PER_TOKEN, rel_tol=0.05)
    # Sums add and subtract: a window's fit is the difference of two cumulative ones.
    a, b = steps(500, random.Random(3)), steps(500, random.Random(4))
    window = solve((a + b) - a)
    assert window is not None and math.isclose(window.per_token_s, PER_TOKEN, rel_tol=1e-6)


def test_an_undetermined_or_absurd_fit_is_none() -> None:
    assert solve(steps(MIN_FIT_STEPS - 1, random.Random(1))) is None  # too few steps
    same = StepFitSums()
    for b in range(1, 200):
        same.observe(BASE + PER_TOKEN * 512 + PER_SEQUENCE * b, 512, b)  # p never varies
    assert solve(same) is None
    falling = StepFitSums()
    for i in range(200):
        p = (i * 37) % 500
        falling.observe(0.1 - 1e-4 * p, p, 8)  # more tokens, shorter steps: not a cost
    assert solve(falling) is None
    one_batch = StepFitSums()  # the same sequences in every step: a line in p alone
    for i in range(200):
        p = (i * 37) % 500
        one_batch.observe(BASE + PER_TOKEN * p + PER_SEQUENCE * 8, p, 8)
    fit = solve(one_batch)
    assert fit is not None and math.isclose(fit.per_token_s, PER_TOKEN, rel_tol=1e-9)


def long_streams(decode_steps: int, prompts: list[int], noise: float,
                 rng: random.Random) -> StepFitSums:
    """A few prompts, then their streams decoding for `decode_steps`, every fourth step
    verifying 4 drafted tokens per sequence (extra tokens proportional to the sequences, as
    draft-assist's); each step's context adds what the fit does not model."""
    sums, context = StepFitSums(), 0
    for i, p in enumerate(prompts):
        context += p
        sums.observe(BASE + PER_TOKEN * p + PER_SEQUENCE * (i + 1) + 1e-7 * context, p, i + 1)
    b = len(prompts)
    for i in range(decode_steps):
        extra = 4 * b if i % 4 == 0 else 0
        context += b
        y = BASE + PER_TOKEN * extra + PER_SEQUENCE * b + 1e-9 * context
        sums.observe(y * (1 + rng.uniform(-noise, noise)), extra, b)
    return sums


def test_more_steps_never_make_a_fit_undetermined() -> None:
    """An engine that served eight prompts of 40-460 tokens and then their long streams
    (the integration assist test's survivor): the fit stays determined however long the
    streams decode. A minimum spread per step (a standard deviation of 16 tokens, the rule
    before) lost it after a few thousand decode steps, and the coordinator fell back to the
    per-request prefill time for the rest of the engine's life."""
    prompts = [40 + 60 * i for i in range(8)]
    for decode_steps in (500, 5000, 50_000, 500_000):
        fit = solve(long_streams(decode_steps, prompts, 0.0, random.Random(decode_steps)))
        assert fit is not None, decode_steps
        assert math.isclose(fit.per_token_s, PER_TOKEN, rel_tol=0.05), (decode_steps, fit)
    # The rule before, on the same steps: undetermined once decoding dominates.
    s = long_streams(50_000, prompts, 0.0, random.Random(0))
    sbb = s.bb - s.b * s.b / s.n
    spread = ((s.pp - s.p ** 2 / s.n) - (s.pb - s.p * s.b / s.n) ** 2 / sbb) / s.n
    assert math.sqrt(spread) < 16


def test_a_fit_the_noise_hides_is_none() -> None:
    """Two short prompts in steps timed with +-50% noise (a busy host): the slope is not
    known to 20% (negative control); forty such prompts determine it."""
    few = solve(long_streams(2000, [40, 60], 0.5, random.Random(5)))
    assert few is None
    many = solve(long_streams(2000, [40, 60] * 20, 0.5, random.Random(5)))
    assert many is not None and math.isclose(many.per_token_s, PER_TOKEN, rel_tol=0.2)


def test_the_timer_counts_steps_that_follow_without_idling() -> None:
    now = [0.0]
    timer = StepTimer(clock=lambda: now[0])
    timer.scheduled({"r1": 512})  # a prefill chunk
    now[0] += 0.015
    timer.scheduled({"r1": 1, "r2": 100})  # r1 continues: the chunk took 15 ms
    now[0] += 0.007
    timer.scheduled({"r1": 1, "r2": 1})
    now[0] += 5.0  # both finished, the engine idled, a new request came
    timer.scheduled({"r3": 40})
    now[0] += 0.006
    timer.scheduled({})  # nothing scheduled: nothing to time next
    now[0] += 1.0
    timer.scheduled({"r3": 1})
    s = timer.sums
    # The 5 s idle gap is not a step; nor are the steps before and after the empty one
    # (nothing continued across it).
    assert s.n == 2
    assert math.isclose(s.y, 0.015 + 0.007)
    assert s.p == 511 + 99 and s.b == 1 + 2
    assert math.isclose(s.py, 511 * 0.015 + 99 * 0.007)


def test_the_sums_travel_through_metrics_and_the_record_exactly() -> None:
    sums = steps(300, random.Random(5))
    load = parse_load("\n".join(sums.metric_lines()) + '\nvllm:num_requests_running 2\n')
    assert load.step_fit == sums.values()
    record = load.report()
    assert record.step_fit == list(sums.values())
    assert parse_sums({}) is None
    lines = [line for line in sums.metric_lines() if "_pb_" not in line]
    assert parse_load("\n".join(lines)).step_fit is None  # one sum missing: none
    bad = [line.replace(line.rpartition(" ")[2], "-1") if "_py_" in line else line
           for line in sums.metric_lines()]
    assert parse_load("\n".join(bad)).step_fit is None
    assert EngineLoad(0, 0, 0.0).report().step_fit is None


def test_the_coordinator_prices_a_prompt_token_at_the_fitted_marginal_cost() -> None:
    # Per-request prefill time says 500 us a token (prefills sharing steps each count the
    # steps whole); the steps say 20 us. Restores measured too (the speeds are a pair).
    measured = {"restored_bytes": 64 << 20, "restore_s": 0.5, "restored_tokens": 4096,
                "prefill_tokens": 100_000, "prefill_s": 50.0}
    fitted = [replace(worker(name), load=WorkerLoad(
        **measured, step_fit=list(steps(400, random.Random(i)).values())))  # type: ignore[arg-type]
              for i, name in enumerate(("a", "b"))]
    costs = estimate(fitted)
    assert costs.prefill.measured and costs.prefill.fit_steps == 800
    assert math.isclose(costs.prefill.value, PER_TOKEN, rel_tol=1e-6)
    assert "fitted from 800 steps" in costs.prefill.source
    assert costs.prefill.workers == 2
    # The control: without the sums, the per-request ratio as before.
    plain = estimate([worker("a", **measured)])
    assert plain.prefill.fit_steps == 0 and math.isclose(plain.prefill.value, 5e-4)
    # An undetermined fit (too few steps) falls back to the ratio too.
    few = replace(fitted[0], load=replace(fitted[0].load, step_fit=list(
        steps(10, random.Random(9)).values())))
    assert math.isclose(estimate([few]).prefill.value, 5e-4)


@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    engine = start_engine(tmp_path_factory.mktemp("step-fit"), "fit")
    try:
        wait_active(engine)
        yield engine
    finally:
        stop_process(engine.proc)


def test_a_sim_engine_under_concurrent_prompts_fits_its_cost_models_marginal_token(
        sim_engine: Engine) -> None:
    rng = random.Random(11)
    prompts = [" ".join(["word"] * rng.randint(30, 900)) for _ in range(48)]

    def send(prompt: str) -> None:
        sim_engine.ok("/v1/completions", {"prompt": prompt, "max_tokens": rng.randint(8, 30)})

    with ThreadPoolExecutor(8) as pool:  # eight at a time: prompts share steps
        list(pool.map(send, prompts))
    with urllib.request.urlopen(sim_engine.url + "/metrics", timeout=10) as r:
        load = parse_load(r.read().decode())
    assert load.step_fit is not None
    fit = solve(StepFitSums.of(load.step_fit))
    assert fit is not None
    model = sim_model("sim-small").cost
    scale = 0.05  # start_engine's --time-scale
    assert load.prefill_s is not None and load.prefill_tokens
    ratio = load.prefill_s / load.prefill_tokens
    print(f"marginal prompt token: fitted {fit.per_token_s * 1e6:.3f} us from {fit.steps} "
          f"steps, the cost model's b x scale {model.b * scale * 1e6:.3f} us; per-request "
          f"prefill time / tokens {ratio * 1e6:.3f} us ({ratio / fit.per_token_s:.1f}x)")
    assert math.isclose(fit.per_token_s, model.b * scale, rel_tol=0.1)
    assert ratio > 1.5 * fit.per_token_s  # what the fit corrects: the ratio overstates it
