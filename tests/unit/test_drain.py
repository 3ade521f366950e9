"""Drain intents over a decoded view (no processes): the gateway's local fallback admits and
places nothing on a drained worker, the streams to migrate are those under --migrate, and
the node publishes a drained worker as draining or drained."""

from __future__ import annotations

import dataclasses

import msgspec

from lumend.cluster.keys import Keys
from lumend.cluster.models import EngineInfo, Intent, WorkerRecord
from lumend.cluster.view import ClusterView
from lumend.failover.intents import DrainStates, drain_intent
from lumend.gateway.checkpoints import place, route
from lumend.gateway.routing import choose_worker
from lumend.gateway.server import migrating

from .test_gateway_checkpoints import view, worker


def drain(target: str, kind: str = "worker", migrate: bool = False) -> Intent:
    return Intent(kind="drain", target=target, target_kind=kind,  # type: ignore[arg-type]
                  requested_at=1.0, requested_by="t", migrate=migrate)


def with_engine(w: WorkerRecord) -> WorkerRecord:
    return msgspec.structs.replace(w, engines=[EngineInfo(id=f"{w.name}/0", role="active",
                                                          state="active", url="http://e")])


def drained_view(*intents: Intent) -> ClusterView:
    v = view(with_engine(worker("a0", "a", running=0)), with_engine(worker("b0", "b", running=5)),
             with_engine(worker("c0", "c", running=9)))
    return dataclasses.replace(v, intents=list(intents))


def test_local_admission_skips_drained_workers_and_nodes() -> None:
    assert choose_worker(drained_view(), None, {}).worker == "a0"  # type: ignore[union-attr]
    # The least loaded worker is drained: the next one; its node drained: the same.
    for intent in (drain("a0"), drain("a", "node")):
        target = choose_worker(drained_view(intent), None, {})
        assert target is not None and target.worker == "b0"
    # Every worker drained: nowhere to admit.
    assert choose_worker(drained_view(drain("a0"), drain("b0"), drain("c", "node")),
                         None, {}) is None


def test_local_placement_and_routing_skip_drained_workers() -> None:
    undrained = drained_view()
    holder = place(undrained, "b0", "r")
    assert holder is not None and holder.worker == "a0"
    placement = place(drained_view(drain("a0")), "b0", "r")
    assert placement is not None and placement.worker == "c0"
    # An interrupted request's holder is drained: recompute elsewhere, not resume there.
    assert route(undrained, holder, "b0", prefix_tokens=160) == ("a0", True)
    assert route(drained_view(drain("a0")), holder, "b0", prefix_tokens=160) == ("c0", False)


def test_streams_to_migrate_are_those_under_a_migrate_intent() -> None:
    assert migrating(drained_view(drain("a0"))) == set()  # without --migrate they finish
    assert migrating(drained_view(drain("a0", migrate=True))) == {"a0"}
    assert migrating(drained_view(drain("b", "node", migrate=True), drain("c0"))) == {"b0"}


def test_a_drained_worker_is_published_draining_then_drained() -> None:
    current: list[ClusterView] = [drained_view()]
    states = DrainStates("a", None, Keys("t"), lambda: current[0], lambda: [])  # type: ignore[arg-type]
    busy = worker("b0", "b", running=2)
    idle = worker("a0", "a")
    assert states.decorate(busy).state == "serving"  # no intent: unchanged
    current[0] = drained_view(drain("a", "node"), drain("b0", migrate=True))
    assert states.decorate(busy).state == "draining"
    assert states.decorate(idle).state == "drained"
    waiting = msgspec.structs.replace(idle, load=msgspec.structs.replace(idle.load, waiting=1))
    assert states.decorate(waiting).state == "draining"  # waiting requests count too
    # A worker that is not serving says what it is instead.
    assert states.decorate(worker("a0", "a", state="recovering")).state == "recovering"
    # The worker's own intent wins over its node's (it says whether to migrate).
    both = drained_view(drain("b", "node"), drain("b0", migrate=True))
    intent = drain_intent(both, busy)
    assert intent is not None and intent.target == "b0" and intent.migrate
