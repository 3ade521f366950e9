"""The cost figures measured from the engines' counters (lumend.coordinator.estimates), how
an engine's /metrics becomes those counters (lumend.engine.adapter), and the coordinator
deciding with them (settings.InForce, CoordinatorService.with_costs)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from msgspec.structs import replace

from lumend.cluster.agent import _counters, _meaningful
from lumend.cluster.models import ClusterSettings, EngineInfo, WorkerLoad, WorkerRecord
from lumend.cluster.view import ClusterView
from lumend.coordinator.estimates import MIN_RESTORE_BYTES, estimate
from lumend.coordinator.policy import MEAN_PROMPT_TOKENS, PolicyConfig
from lumend.coordinator.service import CoordinatorService
from lumend.coordinator.settings import (
    SettingError,
    costs_in_use,
    in_force,
    measured_policy_config,
    parse_setting,
    policy_config,
)
from lumend.engine.adapter import EngineLoad, parse_load
from lumend.engine.sim_checkpoint import CheckpointCounters
from lumend.rpc.messages import CheckpointRef, RecoverAsk

from .test_coordinator_loadbook import cluster
from .test_coordinator_loadbook import worker as lb_worker

GB = 1e9
DEFAULT = PolicyConfig()


def worker(name: str, at: float = 100.0, **load: float | None) -> WorkerRecord:
    return WorkerRecord(name=name, node=f"n-{name}", gpus=[0], engine="sim", model="m",
                        state="serving", updated_at=at,
                        engines=[EngineInfo(id=f"{name}/e0", role="active", state="active",
                                            url="http://127.0.0.1:1")],
                        load=WorkerLoad(**load))  # type: ignore[arg-type]


def restores(name: str, nbytes: float, seconds: float, at: float = 100.0,
             tokens: int | None = None, prefill: float | None = 2e-4) -> WorkerRecord:
    """A worker whose engine restored `nbytes` in `seconds` and, as a vLLM engine does,
    measured its prefill (`prefill` seconds per token over 100 000 tokens; None: a sim
    engine's, which measures none)."""
    measured = {} if prefill is None else {"prefill_tokens": 100_000,
                                           "prefill_s": prefill * 100_000}
    return worker(name, at, restored_bytes=int(nbytes), restore_s=seconds,
                  restored_tokens=tokens, **measured)


# -- the estimator -----------------------------------------------------------------------

def test_no_counters_keeps_the_default_constants() -> None:
    costs = estimate([worker("w0"), worker("w1")])
    assert costs.restore.value == DEFAULT.restore_bytes_per_s
    assert costs.prefill.value == DEFAULT.recompute_s_per_token
    assert not costs.restore.measured and costs.restore.source == "default"
    assert costs.apply(DEFAULT) is DEFAULT


def test_restore_bandwidth_is_the_ratio_of_sums() -> None:
    # 6 GB in 2 s and 2 GB in 2 s: 8 GB / 4 s = 2 GB/s (not the mean of 3 and 1 GB/s)
    costs = estimate([restores("w0", 6 * GB, 2.0, at=50.0), restores("w1", 2 * GB, 2.0),
                      worker("w2")])
    assert costs.restore.value == pytest.approx(2 * GB)
    assert costs.restore.workers == 2 and costs.restore.source == "measured from 2 workers"
    assert costs.restore.at == 100.0  # the newest record it reads
    assert costs.prefill.value == pytest.approx(2e-4) and costs.prefill.workers == 2


def test_kv_bytes_per_token_come_from_the_same_restores() -> None:
    costs = estimate([restores("w0", 6 * GB, 2.0, tokens=200_000),
                      restores("w1", 2 * GB, 2.0, tokens=50_000),
                      # an absurd restore sample: its tokens are not counted either
                      restores("w2", 4 * GB, 0.0, tokens=1)])
    assert costs.kv.value == pytest.approx(8 * GB / 250_000) and costs.kv.workers == 2
    assert costs.apply(policy_config(None)).kv_bytes_per_token == pytest.approx(32_000)
    # engines of an older release count no tokens: the constant stays
    assert not estimate([restores("w0", 6 * GB, 2.0)]).kv.measured


def test_prefill_cost_is_seconds_per_token() -> None:
    restored = {"restored_bytes": 2_000_000_000, "restore_s": 1.0}  # its partner speed
    costs = estimate([worker("w0", prefill_tokens=10_000, prefill_s=1.5, **restored),
                      worker("w1", prefill_tokens=30_000, prefill_s=2.5)])
    assert costs.prefill.value == pytest.approx(4.0 / 40_000)
    assert costs.prefill.source == "measured from 2 workers"


@pytest.mark.parametrize("nbytes, seconds", [
    (4 * GB, 0.0),                 # zero seconds
    (4 * GB, -1.0),                # a negative count
    (-4 * GB, 1.0),
    (MIN_RESTORE_BYTES - 1, 0.5),  # too small to say anything about bandwidth
    (4 * GB, math.nan),
    (4 * GB, math.inf),
    (4e15, 1.0),                   # 4 PB/s: not a measurement
], ids=["zero-s", "negative-s", "negative-bytes", "tiny", "nan", "inf", "absurd-rate"])
def test_absurd_samples_are_ignored(nbytes: float, seconds: float) -> None:
    bad = worker("bad", restored_bytes=int(nbytes), restore_s=seconds)
    alone = estimate([bad])
    assert not alone.restore.measured and alone.restore.value == DEFAULT.restore_bytes_per_s
    mixed = estimate([bad, restores("good", 3 * GB, 1.0)])
    assert mixed.restore.value == pytest.approx(3 * GB) and mixed.restore.workers == 1


def test_an_engine_restart_is_a_smaller_sample_not_a_negative_one() -> None:
    before = estimate([restores("w0", 8 * GB, 4.0), restores("w1", 2 * GB, 1.0)])
    # w1's engine restarted: its counters start again from 0, then grow
    reset = estimate([restores("w0", 8 * GB, 4.0), restores("w1", 0, 0.0)])
    assert reset.restore.value == pytest.approx(2 * GB) and reset.restore.workers == 1
    regrown = estimate([restores("w0", 8 * GB, 4.0), restores("w1", 4 * GB, 1.0)])
    assert before.restore.value == pytest.approx(2 * GB)
    assert regrown.restore.value == pytest.approx(12 * GB / 5.0)


def test_a_view_with_no_new_restore_keeps_the_last_value() -> None:
    records = [restores("w0", 5 * GB, 2.0)]
    first = estimate(records)
    # later views: w0 still reports the same counters, a new worker has restored nothing
    later = estimate([*records, worker("w1", restored_bytes=0, restore_s=0.0)])
    assert later == first


def test_apply_replaces_the_constants_and_the_weights_derived_from_them() -> None:
    costs = estimate([restores("w0", 5 * GB, 1.0, prefill=None),
                      worker("w1", prefill_tokens=10_000, prefill_s=3.0)])
    cost_aware = policy_config(None)
    applied = costs.apply(cost_aware)
    assert applied.restore_bytes_per_s == pytest.approx(5 * GB)
    assert applied.recompute_s_per_token == pytest.approx(3e-4)
    assert applied.alpha == pytest.approx(1 / (5 * GB))
    assert applied.beta == pytest.approx(MEAN_PROMPT_TOKENS * 3e-4)


def test_differs_by_more_than_five_percent_or_source() -> None:
    a = estimate([restores("w0", 5 * GB, 1.0)])
    assert not a.differs(estimate([restores("w0", 5.1 * GB, 1.0)]))
    assert a.differs(estimate([restores("w0", 6 * GB, 1.0)]))
    assert a.differs(estimate([]))


def test_a_speed_measured_alone_is_held_until_its_partner_is_measured() -> None:
    # Restores measured (loopback, slow), no prefill time yet (none finished). Weighing
    # the measured restore against the constant prefill (another machine's) would flip
    # every recovery to recompute; the pair stays the constants, the restore is shown held.
    sim = estimate([restores("w0", 40e6, 1.0, tokens=2_500, prefill=None)])
    assert not sim.restore.measured and sim.restore.value == DEFAULT.restore_bytes_per_s
    assert sim.restore.held is not None and sim.restore.held.value == pytest.approx(40e6)
    assert "not used until recompute_s_per_token is measured" in sim.restore.source
    assert sim.kv.measured and sim.kv.value == pytest.approx(16_000)  # a fact: used
    [row] = [r for r in sim.rows(100.0) if r["key"] == "restore_bytes_per_s"]
    assert row["source"] == "held" and row["held"] == {
        "value": pytest.approx(40e6), "workers": 1, "amount": 40e6, "over": 1.0,
        "waits_for": "recompute_s_per_token"}
    cfg = sim.apply(policy_config(None))
    assert cfg.restore_bytes_per_s == DEFAULT.restore_bytes_per_s
    assert cfg.kv_bytes_per_token == pytest.approx(16_000)
    # and the other way round: prefill measured, no restore yet
    fresh = estimate([worker("w0", prefill_tokens=100_000, prefill_s=30.0)])
    assert not fresh.prefill.measured and fresh.prefill.held is not None
    # both measured: both used
    both = estimate([restores("w0", 40e6, 1.0, prefill=3e-4)])
    assert both.restore.value == pytest.approx(40e6) and both.prefill.value == 3e-4


# -- the settings a coordinator decides with ----------------------------------------------

def test_policy_config_takes_the_measured_figures_in_force() -> None:
    costs = estimate([restores("w0", 2 * GB, 1.0)])
    cfg = policy_config(in_force(ClusterSettings(theta=7.0), costs))
    assert cfg.restore_bytes_per_s == pytest.approx(2 * GB)
    assert cfg.alpha == pytest.approx(1 / (2 * GB)) and cfg.theta == 7.0
    assert cfg.recompute_s_per_token == pytest.approx(2e-4)
    # control: the stored settings alone keep the constant
    assert policy_config(ClusterSettings(theta=7.0)).restore_bytes_per_s == 25e9
    # decisions = paper: alpha and beta are the operator's, whatever was measured
    paper = policy_config(in_force(ClusterSettings(decisions="paper", alpha=1.0), costs))
    assert paper.alpha == 1.0


def test_costs_constant_keeps_the_constants_whatever_was_measured() -> None:
    records = [restores("w0", 2 * GB, 1.0, tokens=100_000)]
    assert costs_in_use(None, records).restore.measured  # the default: measured
    constant = parse_setting(ClusterSettings(), "costs", "constant")
    costs = costs_in_use(constant, records)
    assert not any(e.measured for e in costs.all)
    assert policy_config(in_force(constant, costs)).restore_bytes_per_s == 25e9
    with pytest.raises(SettingError, match="use one of measured, constant"):
        parse_setting(ClusterSettings(), "costs", "guessed")
    # one call, as a caller deciding from a view at a time uses it
    assert measured_policy_config(None, records).restore_bytes_per_s == pytest.approx(2 * GB)
    assert measured_policy_config(constant, records).restore_bytes_per_s == 25e9


def test_the_coordinator_decides_with_what_its_view_measured() -> None:
    # A request interrupted on a0 with 20 blocks checkpointed on c0 (its KV: 84 MB). At the
    # default 25 GB/s restoring them beats recomputing 320 tokens on b0; at 10 MB/s, as c0's
    # engine measured its restores, it takes 8 s and recomputing wins.
    def view(c0_load: WorkerLoad) -> ClusterView:
        return cluster([lb_worker("a0", "a"), lb_worker("b0", "b"),
                        replace(lb_worker("c0", "c"), load=c0_load)], gateways=("gw",))

    views = [view(WorkerLoad())]
    service = CoordinatorService("a", 1, lambda: views[-1])
    ask = RecoverAsk("r", "a0", 320, "", CheckpointRef("ck", "c0", "tcp://c:7441"), "gw")
    assert service.recover(ask).resume  # control: the default constant
    views.append(view(WorkerLoad(restored_bytes=50_000_000, restore_s=5.0,
                                 prefill_tokens=100_000, prefill_s=10.0)))
    costed = service._read()
    assert service._read() is costed  # once per view: the load book's columns are cached
    assert service.book.columns(costed).cfg.restore_bytes_per_s == pytest.approx(1e7)
    assert service.costs.restore.workers == 1
    slow = service.recover(dataclasses.replace(ask, request_id="r2"))
    assert not slow.resume and "recompute" in slow.reason, slow.reason
    # control: the same slow restores with no prefill measured (a sim engine's) are held,
    # and the request resumes as with the constants
    views.append(view(WorkerLoad(restored_bytes=50_000_000, restore_s=5.0)))
    assert service.recover(dataclasses.replace(ask, request_id="r3")).resume


# -- an engine's /metrics into the worker's record ----------------------------------------

def test_parse_load_reads_the_cost_counters() -> None:
    text = "\n".join([
        'vllm:num_requests_running{model_name="m"} 2',
        "lumen_ckpt_restored_bytes_total 1048576",
        "lumen_ckpt_restore_seconds_total 0.25",
        'vllm:request_prefill_time_seconds_sum{model_name="m",engine="0"} 3.5',
        'vllm:prompt_tokens_total{model_name="m",engine="0"} 9000',
        'vllm:prompt_tokens_by_source_total{model_name="m",engine="0",source="local_compute"}'
        " 7000",
        'vllm:prompt_tokens_by_source_total{model_name="m",engine="0",'
        'source="external_kv_transfer"} 2000',
    ])
    load = parse_load(text)
    assert (load.restored_bytes, load.restore_s) == (1048576, 0.25)
    assert (load.prefill_tokens, load.prefill_s) == (7000, 3.5)  # computed tokens only
    older = parse_load(text.rsplit("\nvllm:prompt_tokens_by_source", 2)[0])
    assert older.prefill_tokens == 9000  # no by-source counter: all prompt tokens


def test_an_engine_without_the_counters_reports_none() -> None:
    load = parse_load('vllm:num_requests_running{model_name="m"} 1\n')
    assert load.restored_bytes is None and load.prefill_s is None
    report = load.report()
    assert report.restored_bytes is None and report.running == 1


def test_the_sim_engines_counters_read_back() -> None:
    counters = CheckpointCounters(restored_bytes=3 << 20, restored_kv_tokens=192,
                                  restore_seconds=0.125)
    load = parse_load("\n".join(counters.metric_lines()))
    assert (load.restored_bytes, load.restored_tokens, load.restore_s) == (3 << 20, 192, 0.125)


def test_the_record_carries_the_counters_exactly_and_a_write_skips_their_growth() -> None:
    # A month of a busy engine: 1.3e9 steps. Exact, so that the growth of a few seconds is
    # readable (rounding relative to the total hid it after hours); seconds to the us.
    load = EngineLoad(0, 0, 0.0, restored_bytes=123_456_789, restore_s=0.1234567891,
                      steps=1_300_000_123, step_s=2_600_000.0123456789,
                      prefill_tokens=9_876_543_211)
    report = load.report()
    assert report.restored_bytes == 123_456_789 and report.restore_s == 0.123457
    assert report.steps == 1_300_000_123 and report.step_s == 2_600_000.012346
    assert report.prefill_tokens == 9_876_543_211
    # The counters alone growing is not a meaningful change of the record (no write at this
    # heartbeat: they are written every COUNTER_REFRESH_S); one exported or not is.
    w = worker("w")
    grown = EngineLoad(0, 0, 0.0, restored_bytes=123_456_789 + 1000, restore_s=0.2,
                       steps=1_300_000_200, step_s=2_600_001.0, prefill_tokens=9_876_543_311)
    assert _meaningful(replace(w, load=report)) == _meaningful(replace(w, load=grown.report()))
    assert _counters(replace(w, load=report)) != _counters(replace(w, load=grown.report()))
    assert _meaningful(replace(w, load=report)) != _meaningful(
        replace(w, load=replace(report, steps=None, step_s=None)))
