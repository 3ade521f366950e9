"""The coordinator's `decisions` setting (issues 15/16): cost-aware admission does not count
checkpoint bytes held as serving load; the paper's L_hat does (the negative control); the
setting is parsed, checked and shown like the others, and old records still decode."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest
from msgspec.structs import replace

from lumend.cluster.models import (
    ClusterSettings,
    WorkerLoad,
    WorkerRecord,
    decode_value,
    encode_value,
)
from lumend.coordinator.policy import MEAN_PROMPT_TOKENS, PolicyConfig
from lumend.coordinator.service import CoordinatorService
from lumend.coordinator.settings import (
    KEYS,
    SettingError,
    as_rows,
    parse_setting,
    policy_config,
)
from lumend.rpc.messages import CheckpointProgress, CheckpointRef, RecoverAsk

from .test_coordinator_loadbook import GIB, cluster, worker

HEAVY = 40 * GIB  # checkpoint pages one worker holds for its peers


def burst(decisions: str, via: str, n: int = 60) -> Counter[str]:
    """`n` admissions at once over three idle workers on three nodes, `a0` holding HEAVY
    bytes of checkpoints: as its heartbeat shows them, or as its holder's Progress stream
    reported them. Returns the admissions per worker."""
    settings = ClusterSettings(decisions=decisions)  # type: ignore[arg-type]
    held = HEAVY if via == "heartbeat" else 0
    workers = [worker("a0", "a", held=held, budget=64 * GIB),
               worker("b0", "b", budget=64 * GIB), worker("c0", "c", budget=64 * GIB)]
    v = cluster(workers, gateways=("gw",), settings=settings)
    service = CoordinatorService("a", 1, lambda: v)
    if via == "progress":
        for i in range(40):
            service.progress(CheckpointProgress(f"old-{i}", "a0", GIB, 4096))
    served: Counter[str] = Counter()
    for i in range(n):
        a = service.admit(f"r{i}", None, "gw")
        assert a.target is not None
        served[a.target.worker] += 1
    return served


@pytest.mark.parametrize("via", ["heartbeat", "progress"])
def test_a_burst_is_balanced_although_one_worker_holds_many_checkpoints(via: str) -> None:
    cost = burst("cost_aware", via)
    mean = sum(cost.values()) / 3
    assert set(cost) == {"a0", "b0", "c0"}
    assert max(cost.values()) / mean <= 1.5, cost
    # Negative control: the paper's L_hat counts 40 GiB as 40 queued requests, so a burst
    # of 60 sends nothing to the worker holding them (the chaos lab's 4/4/0).
    paper = burst("paper", via)
    assert paper["a0"] == 0 and paper["b0"] + paper["c0"] == 60, paper


def test_the_default_decides_in_seconds_and_names_what_it_chose_by() -> None:
    cfg = policy_config(None)
    assert cfg.cost_aware and cfg.admission == "queue"
    assert cfg.alpha == pytest.approx(1 / cfg.restore_bytes_per_s)
    assert cfg.beta == pytest.approx(MEAN_PROMPT_TOKENS * cfg.recompute_s_per_token)
    paper = policy_config(ClusterSettings(decisions="paper", alpha=2.0, beta=3.0, theta=4.0))
    assert not paper.cost_aware and paper.admission == "lhat"
    assert (paper.alpha, paper.beta, paper.theta) == (2.0, 3.0, 4.0)
    assert paper == PolicyConfig(alpha=2.0, beta=3.0, theta=4.0)  # the paper's forms
    v = cluster([worker("a0", "a", running=2), worker("b0", "b", running=1)], gateways=("gw",))
    admitted = CoordinatorService("a", 1, lambda: v).admit("r", None, "gw")
    assert admitted.reason.startswith("admitted to b0 (queue 1, the shortest)")
    assert "checkpoint on a0 (L_hat" in admitted.reason


def test_cost_aware_recovery_compares_estimated_completion() -> None:
    # The holder c0 runs 5 requests but has none waiting for prefill: its queued work is 0 s
    # and restoring 20 blocks (even slowing its 5 a little) beats recomputing them on b0.
    v = cluster([worker("a0", "a"), worker("b0", "b"), worker("c0", "c", running=5)],
                gateways=("gw",))
    service = CoordinatorService("a", 1, lambda: v)
    assert service.admit("r", None, "gw").target.worker == "a0"  # type: ignore[union-attr]
    ask = RecoverAsk("r", "a0", 320, "", CheckpointRef("ck", "c0", "tcp://c:7441"), "gw")
    resumed = service.recover(ask)
    assert resumed.resume and resumed.target is not None and resumed.target.worker == "c0"
    assert "est. resume on c0" in resumed.reason and "recompute on b0" in resumed.reason
    # 40 requests waiting at the holder (40 mean prompts of prefill, ~4.6 s): recompute.
    busy = cluster([worker("a0", "a"), worker("b0", "b"),
                    replace(worker("c0", "c"), load=WorkerLoad(running=5, waiting=40))],
                   gateways=("gw",))
    service._view = lambda: busy
    rerouted = service.recover(ask)
    assert not rerouted.resume and rerouted.target is not None
    assert rerouted.target.worker == "b0"


def test_the_setting_is_parsed_checked_and_shown() -> None:
    s = ClusterSettings()
    assert s.decisions == "cost_aware"
    assert parse_setting(s, "decisions", "paper").decisions == "paper"
    assert parse_setting(s, "decisions", "cost_aware").decisions == "cost_aware"
    with pytest.raises(SettingError, match=r"decisions 'fast' is not a way of deciding; use "
                                           r"one of cost_aware, paper"):
        parse_setting(s, "decisions", "fast")
    with pytest.raises(SettingError, match=r"the settings are: .*decisions"):
        parse_setting(s, "decision", "paper")
    assert "decisions" in KEYS
    rows = {r["key"]: r for r in as_rows(parse_setting(s, "decisions", "paper"))}
    assert rows["decisions"]["value"] == "paper" and rows["decisions"]["default"] is False
    assert {r["key"]: r["default"] for r in as_rows(s)}["decisions"] is True
    # A stored value naming an unknown way of deciding is refused by the decoder, by field.
    with pytest.raises(msgspec.ValidationError, match=r"decisions"):
        decode_value(b'{"decisions": "fast"}', ClusterSettings)


def test_the_assist_objective_is_set_checked_and_reaches_the_policy() -> None:
    s = ClusterSettings()
    assert s.assist_objective == "ttft"
    assert policy_config(s).assist_objective == "ttft"
    throughput = parse_setting(s, "assist_objective", "throughput")
    assert policy_config(throughput).assist_objective == "throughput"
    paper = parse_setting(throughput, "decisions", "paper")
    assert policy_config(paper).assist_objective == "throughput"
    with pytest.raises(SettingError, match=r"assist_objective 'latency' is not an objective; "
                                           r"use one of ttft, throughput"):
        parse_setting(s, "assist_objective", "latency")
    rows = {r["key"]: r for r in as_rows(throughput)}
    assert rows["assist_objective"]["value"] == "throughput"
    assert rows["assist_objective"]["default"] is False
    # The default is not written: a node of an older release still reads the value.
    assert b"assist_objective" not in msgspec.json.encode(s)
    with pytest.raises(msgspec.ValidationError, match=r"assist_objective"):
        decode_value(b'{"assist_objective": "latency"}', ClusterSettings)


def test_old_records_decode_with_the_defaults() -> None:
    # A `config` value written before the setting existed: cost-aware from now on.
    old = decode_value(b'{"alpha": 1e-9, "beta": 2.0, "theta": 10.0, "tau": 8, '
                       b'"mode": "lumen"}', ClusterSettings)
    assert old.decisions == "cost_aware" and old.beta == 2.0
    # A worker record from before the checkpoint-coverage load fields.
    record = decode_value(
        b'{"name": "w", "node": "n", "gpus": [0], "engine": "sim", "model": "m", '
        b'"state": "serving", "load": {"running": 3, "waiting": 1, "kv_usage": 0.5}, '
        b'"updated_at": 1.0}', WorkerRecord)
    assert record.load.running == 3 and record.load.ckpt_running is None


class SettingsOfRelease01(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """ClusterSettings as 0.1 nodes decode it (no `decisions`; unknown fields refused)."""

    alpha: float = 1.0 / (1 << 30)
    beta: float = 1.0
    theta: float = 48.0
    tau: int = 64
    mode: str = "lumen"


def test_a_setting_written_now_is_read_by_a_node_of_the_previous_release() -> None:
    # During a rolling upgrade `lumenctl config set theta 40` must not write `decisions`
    # (at its default): the old nodes would refuse the whole value and use their defaults.
    written = encode_value(ClusterSettings(theta=40.0))
    assert msgspec.json.decode(written) == {"theta": 40.0}
    assert msgspec.json.decode(written, type=SettingsOfRelease01).theta == 40.0
