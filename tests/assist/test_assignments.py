"""The coordinator's draft-assist assignments (Algorithm 3) over a decoded view, no processes:
who drafts for whom, when an assignment ends, and the counters it carries."""

from __future__ import annotations

from msgspec.structs import replace

from lumend.cluster.keys import Keys
from lumend.cluster.models import (
    AssistAssignment,
    AssistUsage,
    ClusterSettings,
    EngineInfo,
    Event,
    WorkerRecord,
    decode_value,
)
from lumend.cluster.store import Delete, Op, Put
from lumend.cluster.view import ClusterView
from lumend.coordinator.service import CoordinatorService

from ..unit.test_gateway_checkpoints import node, worker

KEYS = Keys("t")
DRAFT = "tcp://10.0.0.9:5555"


def up(w: WorkerRecord) -> WorkerRecord:
    return replace(w, engines=[EngineInfo(id=f"{w.name}/0", role="active", state="active",
                                          url=f"http://{w.name}:1")])


def assisting(name: str, node_name: str, draft: str = DRAFT) -> WorkerRecord:
    return replace(worker(name, node_name, state="assisting"), draft=draft)


def view(*workers: WorkerRecord, assists: dict[str, AssistAssignment] | None = None,
         settings: ClusterSettings | None = None) -> ClusterView:
    return ClusterView(cluster="t", revision=1, nodes={w.node: node(w.node) for w in workers},
                       workers={w.name: up(w) if w.state == "serving" else w for w in workers},
                       assists=assists or {}, settings=settings)


def puts(ops: list[Op]) -> dict[str, AssistAssignment]:
    return {op.key.removeprefix(KEYS.assists): decode_value(op.value, AssistAssignment)
            for op in ops if isinstance(op, Put) and op.key.startswith(KEYS.assists)}


def decided(ops: list[Op]) -> list[Op]:
    """The ops but the step estimates the coordinator publishes for `config show`."""
    return [op for op in ops if not (isinstance(op, Put) and op.key == KEYS.assist_estimates)]


def events(ops: list[Op]) -> list[Event]:
    return [decode_value(op.value, Event) for op in ops
            if isinstance(op, Put) and op.key.startswith(KEYS.events)]


def test_a_recovering_worker_drafts_for_the_most_loaded_survivor() -> None:
    c = CoordinatorService("n1", 7, lambda: None)
    v = view(worker("a", "n1", running=3), worker("b", "n2", running=9),
             worker("c", "n3", running=5), assisting("r", "n4"))
    ops = c.assist_ops(v, KEYS, now=100.0)
    (a,) = puts(ops).values()
    assert (a.recovering, a.survivor, a.endpoint, a.epoch) == ("r", "b", DRAFT, 7)
    assert [e.kind for e in events(ops)] == ["assist_assigned"]


def test_two_drafters_never_share_a_survivor_and_other_models_are_skipped() -> None:
    c = CoordinatorService("n1", 7, lambda: None)
    other_model = replace(worker("z", "n5", running=50), model="other")
    v = view(worker("a", "n1", running=3), worker("b", "n2", running=9), other_model,
             assisting("r1", "n3", "tcp://h:1"), assisting("r2", "n4", "tcp://h:2"))
    got = puts(c.assist_ops(v, KEYS, now=1.0))
    assert {k: a.survivor for k, a in got.items()} == {"r1": "b", "r2": "a"}


def test_nothing_to_assist_without_a_serving_survivor_or_under_another_policy() -> None:
    c = CoordinatorService("n1", 7, lambda: None)
    assert decided(c.assist_ops(view(assisting("r", "n1"),
                                     worker("s", "n2", state="recovering")), KEYS)) == []
    v = view(worker("a", "n1", running=3), assisting("r", "n2"),
             settings=ClusterSettings(mode="fixed_checkpoint"))
    assert c.assist_ops(v, KEYS) == []  # no draft-assist: no estimates either


def test_an_assignment_ends_when_its_worker_serves_and_counters_are_copied() -> None:
    c = CoordinatorService("n1", 7, lambda: None)
    a = AssistAssignment(id="r:1", recovering="r", survivor="b", endpoint=DRAFT, epoch=5,
                         assigned_at=0.0)
    survivor = replace(worker("b", "n2", running=9),
                       assist=AssistUsage(assignment="r:1", drafter="r", drafted_tokens=40,
                                          accepted_tokens=30))
    # Still assisting: the survivor's counters go into the assignment, nothing else.
    ops = c.assist_ops(view(survivor, assisting("r", "n1"), assists={"r": a}), KEYS)
    assert puts(ops) == {"r": replace(a, drafted_tokens=40, accepted_tokens=30)}
    # Counters unchanged: no write at all.
    same = replace(a, drafted_tokens=40, accepted_tokens=30)
    assert c.assist_ops(view(survivor, assisting("r", "n1"), assists={"r": same}), KEYS) == []
    # Serving again: the assignment is deleted, with an event naming the acceptance.
    ops = c.assist_ops(view(survivor, worker("r", "n1"), assists={"r": same}), KEYS)
    assert [op for op in ops if isinstance(op, Delete)] == [Delete(KEYS.assist("r"))]
    (ended,) = events(ops)
    assert ended.kind == "assist_ended" and "acceptance 0.75" in ended.message


def test_an_assignment_ends_when_the_survivor_stops_serving_and_is_given_anew() -> None:
    c = CoordinatorService("n1", 7, lambda: None)
    a = AssistAssignment(id="r:1", recovering="r", survivor="b", endpoint=DRAFT, epoch=5,
                         assigned_at=0.0)
    v = view(worker("b", "n2", state="failed"), worker("c", "n3", running=1),
             assisting("r", "n1"), assists={"r": a})
    ops = c.assist_ops(v, KEYS)
    assert [e.kind for e in events(ops)] == ["assist_ended", "assist_assigned"]
    assert puts(ops)["r"].survivor == "c"  # the same cycle picks the next survivor
    # One write per key (etcd refuses a transaction naming a key twice).
    keys = [op.key for op in ops]
    assert len(keys) == len(set(keys))
