"""Recovery plans (`recovery/<worker>`) over decoded views, no processes: what a decision
adds, the record's bounds, when the worker serves again, retention and expiry."""

from __future__ import annotations

import dataclasses
import json

import msgspec
from msgspec.structs import replace
from rich.console import Console

from lumenctl.render import as_json, status_tables
from lumenctl.report import status_document
from lumend.cluster.keys import Keys
from lumend.cluster.models import (
    ClusterSettings,
    EngineInfo,
    Event,
    Intent,
    RecoveryDecision,
    RecoveryPlan,
    WorkerRecord,
    decode_value,
    encode_value,
)
from lumend.cluster.store import Delete, KeyValue, Op, Put, Snapshot
from lumend.cluster.view import ClusterView, build_view
from lumend.coordinator.plans import (
    DECISIONS_KEPT,
    REASON_CHARS,
    advance,
    new_plan,
    summary,
    with_decision,
)
from lumend.coordinator.service import CoordinatorService
from lumend.rpc.messages import CheckpointRef, RecoverAsk

from .test_gateway_checkpoints import node, worker

KEYS = Keys("t")


def up(w: WorkerRecord, pid: int = 100) -> WorkerRecord:
    return replace(w, engines=[EngineInfo(id=f"{w.name}/0", role="active", state="active",
                                          url=f"http://{w.name}:1", pid=pid)])


def view(*workers: WorkerRecord, plans: dict[str, RecoveryPlan] | None = None,
         intents: list[Intent] | None = None) -> ClusterView:
    return ClusterView(cluster="t", revision=1, nodes={w.node: node(w.node) for w in workers},
                       workers={w.name: w for w in workers}, recoveries=plans or {},
                       intents=intents or [])


def four(victim_state: str = "serving", victim_pid: int = 100) -> ClusterView:
    return view(up(worker("a", "n1", state=victim_state), victim_pid),
                up(worker("b", "n2", running=1)), up(worker("c", "n3", running=2)),
                up(worker("d", "n4", running=3)))


def ask(request: str, holder: str | None) -> RecoverAsk:
    ckpt = None if holder is None else CheckpointRef(f"ck-{request}", holder, "tcp://h:1")
    return RecoverAsk(request, "a", 320, "", ckpt, "gw")


def plans(ops: list[Op]) -> dict[str, RecoveryPlan]:
    return {op.key.removeprefix(KEYS.recoveries): decode_value(op.value, RecoveryPlan)
            for op in ops if isinstance(op, Put) and op.key.startswith(KEYS.recoveries)}


def events(ops: list[Op]) -> list[Event]:
    return [decode_value(op.value, Event) for op in ops
            if isinstance(op, Put) and op.key.startswith(KEYS.events)]


def decision(i: int, target: str = "b", reason: str = "because") -> RecoveryDecision:
    return RecoveryDecision(request=f"r{i}", target=target, action="resume", reason=reason,
                            at=float(i), epoch=7, holder=target)


def test_each_decision_lands_in_the_failed_workers_plan_under_the_epoch() -> None:
    v = four()
    c = CoordinatorService("n2", 7, lambda: v)
    for request, holder in [("r1", "b"), ("r2", "c"), ("r3", None)]:
        c.recover(ask(request, holder))
    ops = c.recovery_ops(v, KEYS, now=50.0)
    plan = plans(ops)["a"]
    assert (plan.worker, plan.cause, plan.epoch, plan.total) == ("a", "failed", 7, 3)
    assert [(d.request, d.target, d.action, d.holder) for d in plan.decisions] == [
        ("r1", "b", "resume", "b"), ("r2", "c", "resume", "c"), ("r3", "b", "recompute", "")]
    assert (plan.resumed, plan.recomputed, plan.targets) == (2, 1, {"b": 2, "c": 1})
    assert all(d.reason.startswith(f"{d.action} on {d.target} after a failed")
               for d in plan.decisions)
    assert plan.engines == ["a/0:100"] and not plan.down_seen  # it still looked serving
    # Read back unchanged: nothing more to write.
    assert c.recovery_ops(view(*v.workers.values(), plans={"a": plan}), KEYS, now=51.0) == []


def test_the_record_keeps_the_newest_decisions_and_counts_them_all() -> None:
    plan = new_plan("a", "failed", None, False, 0.0, 7)
    for i in range(3 * DECISIONS_KEPT):
        plan = with_decision(plan, decision(i, "bc"[i % 2], "x" * 10 * REASON_CHARS))
    assert len(plan.decisions) == DECISIONS_KEPT
    assert [d.request for d in plan.decisions] == [
        f"r{i}" for i in range(2 * DECISIONS_KEPT, 3 * DECISIONS_KEPT)]
    assert plan.total == 3 * DECISIONS_KEPT == sum(plan.targets.values())
    assert plan.targets == {"b": 1.5 * DECISIONS_KEPT, "c": 1.5 * DECISIONS_KEPT}
    assert all(len(d.reason) == REASON_CHARS for d in plan.decisions)
    # The value stays small whatever the failure's size (etcd's default limit is 1.5 MiB).
    assert len(encode_value(plan)) < DECISIONS_KEPT * (REASON_CHARS + 200)
    assert summary(plan) == (f"{3 * DECISIONS_KEPT} interrupted requests: "
                             f"{3 * DECISIONS_KEPT} resumed, 0 recomputed; on b 96, c 96")


def test_the_plan_closes_when_a_new_engine_serves_and_is_deleted_after_retention() -> None:
    v = four()
    c = CoordinatorService("n2", 7, lambda: v, plan_retain_s=60.0)
    c.recover(ask("r1", "b"))
    stored = plans(c.recovery_ops(v, KEYS, now=10.0))["a"]
    # Same engine, still serving: not back yet (the heartbeat has not caught up).
    assert c.recovery_ops(view(*v.workers.values(), plans={"a": stored}), KEYS, 12.0) == []
    restarted = four(victim_pid=200)
    restarted = view(*restarted.workers.values(), plans={"a": stored})
    ops = c.recovery_ops(restarted, KEYS, now=20.0)
    closed = plans(ops)["a"]
    assert closed.served_again_at == 20.0 and closed.total == 1
    (event,) = events(ops)
    assert event.kind == "recovery_plan" and event.message.startswith("a serves again")
    assert "1 interrupted request: 1 resumed, 0 recomputed; on b 1" in event.message
    kept = view(*restarted.workers.values(), plans={"a": closed})
    assert c.recovery_ops(kept, KEYS, now=79.0) == []
    assert c.recovery_ops(kept, KEYS, now=80.0) == [Delete(KEYS.recovery("a"))]


def test_a_worker_seen_down_serves_again_with_the_same_engine_and_a_new_failure_starts_over(
) -> None:
    down = four(victim_state="recovering")
    c = CoordinatorService("n2", 7, lambda: down)
    c.recover(ask("r1", "c"))
    first = plans(c.recovery_ops(down, KEYS, now=5.0))["a"]
    assert first.down_seen
    back = view(*four().workers.values(), plans={"a": first})
    closed = plans(c.recovery_ops(back, KEYS, now=9.0))["a"]
    assert closed.served_again_at == 9.0
    # It fails again: a plan of its own, not more decisions on the closed one.
    again = view(*four().workers.values(), plans={"a": closed})
    c._view = lambda: again
    c.recover(ask("r2", "d"))
    second = plans(c.recovery_ops(again, KEYS, now=30.0))["a"]
    assert second.served_again_at is None and second.failed_at > closed.failed_at
    assert [d.request for d in second.decisions] == ["r2"] and second.total == 1


def test_a_seen_down_flag_is_written_once_and_a_quiet_serving_worker_counts_as_back() -> None:
    plan = with_decision(new_plan("a", "failed", up(worker("a", "n1")), True, 0.0, 7),
                         decision(1))
    record = up(worker("a", "n1"))
    assert advance(plan, record, True, 10.0, 7).plan == plan  # nothing to say yet
    step = advance(plan, None, False, 10.0, 7)
    assert step.plan is not None and step.plan.down_seen and not step.event
    quiet = advance(plan, record, True, 1.0 + 30.0, 7)  # no break for 30 s: it serves
    assert quiet.plan is not None and quiet.plan.served_again_at == 31.0
    assert advance(plan, None, False, 1.0 + 3600.0, 7).plan is None  # never back: expired


def test_a_new_coordinator_continues_the_stored_plan() -> None:
    v = four(victim_state="recovering")
    old = CoordinatorService("n2", 7, lambda: v)
    old.recover(ask("r1", "b"))
    stored = plans(old.recovery_ops(v, KEYS, now=5.0))["a"]
    later = view(*v.workers.values(), plans={"a": stored})
    new = CoordinatorService("n3", 9, lambda: later)
    new.recover(ask("r2", "c"))
    plan = plans(new.recovery_ops(later, KEYS, now=6.0))["a"]
    assert [(d.request, d.epoch) for d in plan.decisions] == [("r1", 7), ("r2", 9)]
    assert plan.epoch == 9 and plan.failed_at == stored.failed_at and plan.total == 2


def test_a_drain_migration_is_a_plan_with_cause_drained() -> None:
    drain = Intent(kind="drain", target="a", target_kind="worker", requested_at=0,
                   requested_by="op", migrate=True)
    v = view(*four().workers.values(), intents=[drain])
    c = CoordinatorService("n2", 7, lambda: v)
    c.recover(ask("r1", "b"))
    plan = plans(c.recovery_ops(v, KEYS, now=1.0))["a"]
    assert plan.cause == "drained" and plan.down_seen


def test_the_view_decodes_plans_and_skips_one_under_another_name() -> None:
    plan = with_decision(new_plan("a", "failed", None, False, 0.0, 7), decision(1))
    snapshot = Snapshot([
        KeyValue(KEYS.recovery("a"), encode_value(plan), 1, 1, 0),
        KeyValue(KEYS.recovery("b"), encode_value(plan), 2, 2, 0),
        KeyValue(KEYS.recovery("c"), msgspec.json.encode({"worker": "c"}), 3, 3, 0),
    ], revision=3)
    v = build_view(KEYS, snapshot)
    assert v.recoveries == {"a": plan}
    assert sorted(p.key for p in v.problems) == [KEYS.recovery("b"), KEYS.recovery("c")]


def test_status_shows_a_summary_row_and_json_the_record() -> None:
    plan = new_plan("a", "failed", None, False, 0.0, 7)
    for i, target in enumerate(["b", "c", "b"]):
        plan = with_decision(plan, decision(i, target))
    doc = status_document(view(*four().workers.values(), plans={"a": plan}))
    (row,) = doc["recoveries"]
    assert row == msgspec.to_builtins(plan)
    assert json.loads(as_json(doc))["recoveries"][0]["decisions"][2]["target"] == "b"
    console = Console(width=200, record=True)
    console.print(status_tables(doc))
    text = console.export_text()
    assert "recovery plans" in text
    line = next(x for x in text.splitlines() if "b 2, c 1" in x)
    cells = [c.strip() for c in line.strip("│ ").split("│")]
    assert cells[:2] == ["a", "failed"] and cells[3:6] == ["3", "3", "0"]
    assert cells[7] == "recovering"


def test_a_burst_of_admissions_spreads_each_workers_checkpoints_over_its_peers() -> None:
    """Four idle workers, 32 admissions at once: under lumen the checkpoints of the worker
    admitted last in each round (its peers tie on L_hat) take turns over all three peers;
    fixed_checkpoint, the control, gives them all to its one neighbour."""
    holders: dict[str, set[str]] = {}
    for mode in ("lumen", "fixed_checkpoint"):
        workers = [up(worker(f"n{i}-w0", f"n{i}")) for i in range(1, 5)]
        v = dataclasses.replace(view(*workers), settings=ClusterSettings(mode=mode))
        c = CoordinatorService("n1", 7, lambda v=v: v)  # type: ignore[misc]
        admissions = [c.admit(f"r{i}", None, "gw") for i in range(32)]
        holders[mode] = {a.checkpoint.holder for a in admissions
                         if a.target is not None and a.target.worker == "n4-w0"
                         and a.checkpoint is not None}
    assert holders == {"lumen": {"n1-w0", "n2-w0", "n3-w0"}, "fixed_checkpoint": {"n1-w0"}}
