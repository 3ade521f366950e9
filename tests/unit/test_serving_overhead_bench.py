"""bench/serving_overhead.py's accounting, which bench/validate_sim.py shares: histogram sums
and counts read from Prometheus text (the admissions only, of the gateway's decisions), what
the sources observed between two scrapes when an engine is killed or restarts, and the
overhead's line fitted on a known answer."""

from __future__ import annotations

import math
from types import ModuleType

import pytest

from .. import benchmod

GATEWAY = """\
# TYPE lumen_gateway_ttft_seconds histogram
lumen_gateway_ttft_seconds_bucket{model_name="a",le="+Inf"} 3.0
lumen_gateway_ttft_seconds_count{model_name="a"} 3.0
lumen_gateway_ttft_seconds_sum{model_name="a"} 1.5
lumen_gateway_ttft_seconds_count{model_name="b"} 1.0
lumen_gateway_ttft_seconds_sum{model_name="b"} 0.25
lumen_gateway_decision_seconds_count{call="admit"} 4.0
lumen_gateway_decision_seconds_sum{call="admit"} 0.008
lumen_gateway_decision_seconds_count{call="recover"} 2.0
lumen_gateway_decision_seconds_sum{call="recover"} 5.0
lumen_gateway_ttft_seconds_created{model_name="a"} 1.7e9
"""
ENGINE = """\
vllm:time_to_first_token_seconds_count{model_name="m"} 10
vllm:time_to_first_token_seconds_sum{model_name="m"} 2.0
lumen_sim_step_late_seconds_total 0.5
lumen_sim_step_seconds_total 100.0
"""


def load_bench() -> ModuleType:
    return benchmod.load_bench("serving_overhead")


def test_sums_and_counts_over_models_and_the_admissions_only() -> None:
    bench = load_bench()
    gateway = bench.parse_metrics(GATEWAY, bench.GATEWAY_SERIES)
    assert gateway["lumen_gateway_ttft_seconds_count"] == 4
    assert gateway["lumen_gateway_ttft_seconds_sum"] == pytest.approx(1.75)
    assert gateway["lumen_gateway_decision_seconds_count"] == 4  # not the recoveries
    assert bench.mean_of(gateway, "lumen_gateway_decision_seconds") == (
        pytest.approx(0.002), 4)
    engine = bench.parse_metrics(ENGINE, bench.ENGINE_SERIES, bench.ENGINE_COUNTERS)
    assert bench.mean_of(engine, "vllm:time_to_first_token_seconds") == (
        pytest.approx(0.2), 10)
    assert engine["lumen_sim_step_late_seconds_total"] == 0.5
    mean, count = bench.mean_of({}, "vllm:time_to_first_token_seconds")
    assert math.isnan(mean) and count == 0


def test_a_restarted_engine_counts_from_zero_and_a_killed_one_is_left_out() -> None:
    bench = load_bench()
    ttft = "vllm:time_to_first_token_seconds"
    before = {"node-1|lumen_gateway_ttft_seconds_count": 100.0,
              f"w1@http://e1#11|{ttft}_count": 60.0, f"w1@http://e1#11|{ttft}_sum": 30.0,
              f"w2@http://e2#12|{ttft}_count": 40.0, f"w2@http://e2#12|{ttft}_sum": 20.0}
    # w2's engine was killed and a new one (another pid, the same URL) served 5 since.
    after = {"node-1|lumen_gateway_ttft_seconds_count": 130.0,
             f"w1@http://e1#11|{ttft}_count": 80.0, f"w1@http://e1#11|{ttft}_sum": 40.0,
             f"w2@http://e2#99|{ttft}_count": 5.0, f"w2@http://e2#99|{ttft}_sum": 1.0}
    total = bench.change(after, before)
    assert total["lumen_gateway_ttft_seconds_count"] == 30
    assert total[f"{ttft}_count"] == 25 and total[f"{ttft}_sum"] == pytest.approx(11.0)
    workers = bench.engine_changes(after, before)
    assert workers["w1"][f"{ttft}_count"] == 20 and workers["w2"][f"{ttft}_count"] == 5
    assert "node-1" not in workers  # a gateway is not an engine
    # Keyed by URL alone, the new engine would have been read as 35 fewer (a negative
    # count): what the pid in the key is for.
    by_url = {k.replace("#99", "#12"): v for k, v in after.items()}
    assert bench.engine_changes(by_url, before)["w2"][f"{ttft}_count"] == -35


def test_the_overhead_line_is_least_squares_over_the_rates() -> None:
    bench = load_bench()

    def row(streams: float, overhead_s: float) -> object:
        return bench.Row("lumen", 1.0, streams, 10, 0.4 + overhead_s, 0.4, 0.4, 0.002,
                         (10, 10), 0.0, 0.001, 0.0, 0.5)

    rows = [row(n, 0.005 + 0.0002 * n) for n in (2.0, 10.0, 30.0)]
    a, b = bench.fit(rows)
    assert a == pytest.approx(0.005) and b == pytest.approx(0.0002)
    assert "lumen: serving overhead (client - engine) ~= 5.0 ms + 0.20 ms x streams" in (
        bench.report(rows))
