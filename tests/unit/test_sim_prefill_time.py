"""The sim engine's prefill time (issue 15): vLLM's `vllm:request_prefill_time_seconds` (0.32:
from a request's first scheduled step to its first token, observed when it finishes),
measured on the sim scheduler's own steps in the time base of its other exported seconds
(modelled x --time-scale), so that a sim cluster's coordinator estimates the prefill cost
per token from measurements, as a vLLM cluster's does, and the estimate is the sim cost
model's."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import pytest
from msgspec.structs import replace
from prometheus_client.parser import text_string_to_metric_families

from lumenctl.localcluster import stop_process
from lumend.cluster.models import EngineInfo
from lumend.coordinator.estimates import estimate
from lumend.engine.adapter import EngineLoad, parse_load
from lumend.engine.sim_core import (
    BLOCK_SIZE,
    REQUEST_LATENCY_BUCKETS,
    Histogram,
    Scheduler,
    SchedulerLimits,
    SimRequest,
    StepCost,
)
from lumend.engine.sim_models import sim_model

from .test_gateway_checkpoints import worker
from .test_sim_openai import Engine, start_engine, wait_active

MODEL = sim_model("sim-small")
COST: StepCost = MODEL.cost
CHUNK = MODEL.limits.prefill_chunk
SCALE = 0.5  # the engine process's --time-scale


def prefill_steps(prompt: int, restored: int = 0) -> float:
    """Modelled seconds from a lone request's first step to its first token: its prompt in
    chunks, the last one also decoding it (one sequence, its whole prompt as context)."""
    left, seconds = prompt - restored, 0.0
    while left > CHUNK:
        seconds += COST.step_time(CHUNK, 0, 0)
        left -= CHUNK
    return seconds + COST.step_time(left, 1, prompt)


def run(scheduler: Scheduler, scale: float = 1.0) -> None:
    """Steps until idle, each `scale` x its modelled duration on the timeline."""
    while not scheduler.idle():
        duration, decoding = scheduler.begin_step()
        scheduler.end_step(decoding, step_s=duration * scale)


def request(name: str, prompt: int, max_tokens: int = 4, restored: int = 0) -> SimRequest:
    return SimRequest(name, [65] * prompt, max_tokens, lambda _: None, prefilled=restored)


# -- the scheduler ----------------------------------------------------------------------


def test_prefill_time_is_the_steps_from_the_first_scheduled_to_the_first_token() -> None:
    s = Scheduler(0, COST, MODEL.limits)
    r = request("a", 1100, max_tokens=3)  # three chunks: 512, 512, 76
    s.add(r)
    while not r.output:
        _, decoding = s.begin_step()
        s.end_step(decoding)
    assert r.scheduled_s == 0.0
    assert r.prefill_s == pytest.approx(prefill_steps(1100), rel=1e-12)
    assert s.prefill_time.count == 0  # observed when the request finishes, as vLLM
    run(s)
    assert s.prefill_time.count == 1
    assert s.prefill_time.sum == pytest.approx(prefill_steps(1100), rel=1e-12)
    assert s.prefill_tokens == 1100
    assert s.now_s > s.prefill_time.sum  # two decode steps after the first token


def test_the_timeline_is_the_steps_as_paced_and_queueing_is_not_prefill() -> None:
    # One request at a time: the second waits for the first to finish (queue time, not
    # prefill); each step takes 3x its modelled duration on the timeline.
    s = Scheduler(0, COST, SchedulerLimits(max_batch=1, prefill_chunk=CHUNK,
                                           kv_blocks=4096))
    first, second = request("a", 300, max_tokens=20), request("b", 200, max_tokens=2)
    s.add(first)
    s.add(second)
    run(s, scale=3.0)
    assert first.prefill_s == pytest.approx(3.0 * prefill_steps(300), rel=1e-12)
    assert first.prefill_s is not None and second.scheduled_s is not None
    assert second.scheduled_s > first.prefill_s
    assert second.prefill_s == pytest.approx(3.0 * prefill_steps(200), rel=1e-12)
    assert s.prefill_time.count == 2
    assert s.prefill_time.sum == pytest.approx(
        3.0 * (prefill_steps(300) + prefill_steps(200)), rel=1e-12)


def test_a_batch_shares_its_steps() -> None:
    # Two prompts prefilled in the same step: each request's prefill time is the whole
    # step (vLLM's interval per request), their tokens counted once.
    s = Scheduler(0, COST, MODEL.limits)
    a, b = request("a", 200, max_tokens=2), request("b", 100, max_tokens=2)
    s.add(a)
    s.add(b)
    run(s)
    step = COST.step_time(300, 2, 300)
    assert a.prefill_s == b.prefill_s == pytest.approx(step, rel=1e-12)
    assert s.prefill_time.sum == pytest.approx(2 * step, rel=1e-12)
    assert s.prefill_tokens == 300


def test_a_resumed_request_counts_its_computed_step_not_its_loaded_tokens() -> None:
    # The sim engine's resume: the checkpointed blocks restored before admission
    # (`prefilled`), at least one token left to compute; vLLM counts such a request's
    # prefill time (from its scheduling) and only its computed tokens as local_compute.
    s = Scheduler(0, COST, MODEL.limits)
    prompt, restored = 1000, 1000 - 1000 % BLOCK_SIZE - BLOCK_SIZE
    r = request("resumed", prompt, max_tokens=2, restored=restored)
    s.add(r)
    run(s)
    assert s.prefill_tokens == prompt - restored == 24
    assert s.prefill_time.count == 1
    assert s.prefill_time.sum == pytest.approx(prefill_steps(prompt, restored), rel=1e-12)
    assert s.prefill_time.sum < prefill_steps(prompt) / 2  # not the whole prompt's


def test_an_aborted_request_is_not_observed_and_none_is_zero() -> None:
    s = Scheduler(0, COST, MODEL.limits)
    assert (s.prefill_time.count, s.prefill_time.sum) == (0, 0.0)
    r = request("a", 100, max_tokens=50)
    s.add(r)
    for _ in range(3):
        _, decoding = s.begin_step()
        s.end_step(decoding)
    r.cancelled = True  # the client went away
    run(s)
    assert r.prefill_s is not None  # it had its first token, but did not finish
    assert (s.prefill_time.count, s.prefill_time.sum) == (0, 0.0)
    assert s.prefill_tokens == 100  # computed: vLLM counts those at the first token


def test_histogram_buckets_are_vllms_and_cumulative() -> None:
    h = Histogram()
    assert h.bounds == REQUEST_LATENCY_BUCKETS
    for v in (0.01, 0.3, 0.31, 9999.0):
        h.observe(v)
    cumulative = dict(h.cumulative())
    assert cumulative[0.3] == 2 and cumulative[0.5] == 3 and cumulative[7680.0] == 3
    assert cumulative[float("inf")] == h.count == 4
    assert h.sum == pytest.approx(0.01 + 0.3 + 0.31 + 9999.0)


# -- a sim engine process, read as lumend and the coordinator read it --------------------


@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    engine = start_engine(tmp_path_factory.mktemp("prefill-time"), "prefill",
                          "--time-scale", str(SCALE))
    try:
        wait_active(engine)
        yield engine
    finally:
        stop_process(engine.proc)


def scrape(engine: Engine) -> str:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as r:
        return str(r.read().decode())


def prefill_samples(text: str, name: str = "vllm:request_prefill_time_seconds"
                    ) -> dict[str, float]:
    """The prefill histogram's (or `name`'s) samples as Prometheus' own parser reads them."""
    [family] = [f for f in text_string_to_metric_families(text) if f.name == name]
    assert family.type == "histogram"
    out = {}
    for sample in family.samples:
        assert sample.labels["model_name"] == MODEL.name
        key = sample.name.rpartition("_")[2]
        out[key if key != "bucket" else f"le={sample.labels['le']}"] = sample.value
    return out


def test_a_sim_engine_measures_its_prefill_cost_per_token(sim_engine: Engine) -> None:
    before_text = scrape(sim_engine)
    # No request yet: nothing observed, and lumend reads a prefill time of 0.
    before = prefill_samples(before_text)
    assert before["count"] == before["sum"] == before["le=+Inf"] == 0
    load0 = parse_load(before_text)
    assert load0.prefill_s == 0.0 and load0.prefill_tokens == 0

    # Prompts of known lengths, one at a time (nothing else in their steps): one chunk,
    # a chunk exactly, and three chunks.
    lengths = []
    for n in (200, CHUNK, 1100):
        prompt = "".join(chr(65 + i % 26) for i in range(n))
        lengths.append(len(sim_engine.tokens(prompt)))
        sim_engine.ok("/v1/completions", {"prompt": prompt, "max_tokens": 3})
    text = scrape(sim_engine)
    load = parse_load(text)
    assert load.prefill_s is not None and load.prefill_tokens is not None
    assert load.prefill_tokens == sum(lengths)

    # The scheduler's steps, at the engine's time scale: exactly the cost model's.
    expected = SCALE * sum(prefill_steps(n) for n in lengths)
    assert load.prefill_s == pytest.approx(expected, rel=1e-9)
    samples = prefill_samples(text)
    assert samples["count"] == 3 and samples["le=+Inf"] == 3
    per_token = load.prefill_s / load.prefill_tokens
    # Against the model's marginal cost of a prompt token at this scale (b, c = 0 here):
    # the fixed step cost a and the last chunk's decode are on top, a few percent to
    # tens of percent for these lengths, never a factor of 2.
    marginal = SCALE * (COST.b + COST.c * CHUNK)
    print(f"measured {per_token * 1e6:.2f} us per prefilled token, model's marginal "
          f"{marginal * 1e6:.2f} us (b x time scale {SCALE}), ratio {per_token / marginal:.3f}")
    assert marginal < per_token < 2 * marginal
    # ... and in the step seconds' time base: the prefill steps are part of them.
    assert load.step_s is not None and load.prefill_s <= load.step_s

    # The coordinator's estimate from the worker's record (the heartbeat's rounding):
    # measured, held until a restore bandwidth is measured too, then used.
    w = replace(worker("w0", "n1"), updated_at=1.0,
                engines=[EngineInfo(id="w0/0", role="active", state="active",
                                    url=sim_engine.url)],
                load=EngineLoad(running=0, waiting=0, kv_usage=0.0,
                                prefill_tokens=load.prefill_tokens,
                                prefill_s=load.prefill_s).report())
    alone = estimate([w]).prefill
    assert alone.held is not None and alone.held.workers == 1
    assert alone.held.value == pytest.approx(per_token, rel=1 / 64)
    both = estimate([replace(w, load=replace(w.load, restored_bytes=64 << 20,
                                             restore_s=2.0, restored_tokens=4096))])
    assert both.prefill.measured
    assert both.prefill.value == pytest.approx(per_token, rel=1 / 64)


def test_an_aborted_stream_adds_computed_tokens_but_no_prefill_time(sim_engine: Engine
                                                                    ) -> None:
    before = parse_load(scrape(sim_engine))
    count = prefill_samples(scrape(sim_engine))["count"]
    body = json.dumps({"prompt": "x" * 300, "max_tokens": 5000, "stream": True}).encode()
    req = urllib.request.Request(sim_engine.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.readline()  # the first chunk's line: it has its first token
    # The connection is closed long before 5000 tokens (~10 s of steps): the engine aborts
    # the request, as vLLM does when its client goes away.
    deadline = time.monotonic() + 5
    while (after := parse_load(scrape(sim_engine))).running:
        assert time.monotonic() < deadline, "the aborted request is still running"
        time.sleep(0.05)
    assert before.prefill_tokens is not None and after.prefill_tokens is not None
    assert after.prefill_tokens - before.prefill_tokens == 300
    assert after.prefill_s == before.prefill_s
    assert prefill_samples(scrape(sim_engine))["count"] == count


def test_the_engines_ttft_is_from_its_api_server_to_the_first_token_out(sim_engine: Engine
                                                                         ) -> None:
    """vLLM's `vllm:time_to_first_token_seconds`, wall clock: observed once per request as
    its first token goes out (streamed or whole), at least the modelled steps before it and
    at most what the client saw (the client's time holds the engine's: a gateway's TTFT
    minus this is the serving path's share, bench/serving_overhead.py)."""
    name = "vllm:time_to_first_token_seconds"
    before = prefill_samples(scrape(sim_engine), name)
    prompt = "".join(chr(65 + i % 26) for i in range(700))
    tokens = len(sim_engine.tokens(prompt))
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "stream": True}).encode()
    req = urllib.request.Request(sim_engine.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    sent = time.monotonic()
    with urllib.request.urlopen(req, timeout=30) as r:
        r.readline()
        client_ttft = time.monotonic() - sent
        r.read()
    streamed = prefill_samples(scrape(sim_engine), name)
    assert streamed["count"] - before["count"] == 1
    engine_ttft = streamed["sum"] - before["sum"]
    print(f"client {client_ttft * 1e3:.1f} ms, engine {engine_ttft * 1e3:.1f} ms, model "
          f"{SCALE * prefill_steps(tokens) * 1e3:.1f} ms")
    assert SCALE * prefill_steps(tokens) <= engine_ttft <= client_ttft
    sim_engine.ok("/v1/completions", {"prompt": prompt, "max_tokens": 4})  # whole
    whole = prefill_samples(scrape(sim_engine), name)
    assert whole["count"] - streamed["count"] == 1
    assert whole["sum"] - streamed["sum"] >= SCALE * prefill_steps(tokens)
    assert whole["le=+Inf"] == whole["count"]
