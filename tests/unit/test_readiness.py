"""lumend/gateway/readiness.py: the phase table, and why a node is not ready, from views."""

from __future__ import annotations

import itertools

from lumend.cluster.models import Intent, NodeRecord, WorkerRecord
from lumend.cluster.view import ClusterView
from lumend.gateway.readiness import TRANSITIONS, NodeReadiness, Phase


def node(name: str) -> NodeRecord:
    return NodeRecord(name=name, address="10.0.0.1", pid=1, version="0", started_at=0.0,
                      updated_at=0.0, gateway="", rpc="", checkpoint="", metrics="")


def worker(name: str, state: str = "serving") -> WorkerRecord:
    return WorkerRecord(name=name, node=name.rsplit("-", 1)[0], gpus=[0], engine="sim",
                        model="sim-small", state=state, updated_at=0.0)  # type: ignore[arg-type]


def view(*, nodes: tuple[str, ...] = ("n1",), workers: tuple[WorkerRecord, ...] = (),
         intents: tuple[Intent, ...] = ()) -> ClusterView:
    return ClusterView(cluster="c", revision=1, nodes={n: node(n) for n in nodes},
                       workers={w.name: w for w in workers}, intents=list(intents))


def test_the_transition_table() -> None:
    """Every (from, to) pair: allowed exactly when in the table, and a refused move leaves
    the phase as it was."""
    for start, to in itertools.product(Phase, Phase):
        readiness = NodeReadiness("n1", lambda: None)
        readiness.phase = start
        moved = readiness.drain() if to is Phase.draining else (
            readiness.stop() if to is Phase.stopping else False)
        assert moved == ((start, to) in TRANSITIONS), (start, to)
        assert readiness.phase is (to if moved else start)
    assert (Phase.draining, Phase.serving) not in TRANSITIONS  # a stop is not taken back


def test_reasons_in_order() -> None:
    serving = view(workers=(worker("n1-w0"),))
    current: list[ClusterView | None] = [None]
    readiness = NodeReadiness("n1", lambda: current[0])
    assert readiness.document()[0] == 503
    assert "not read the cluster" in (readiness.reason() or "")
    current[0] = view(nodes=("n2",), workers=(worker("n2-w0"),))
    assert "not registered" in (readiness.reason() or "")
    current[0] = view(workers=(worker("n1-w0", "failed"),))
    assert readiness.reason() == "no worker in the cluster is serving"
    drained = Intent(kind="drain", target="n1", target_kind="node", requested_at=1.0,
                     requested_by="ops@ctl")
    current[0] = view(workers=(worker("n1-w0"),), intents=(drained,))
    assert "drained by ops@ctl" in (readiness.reason() or "")
    # A drain of a worker, or of another node, does not take this gateway out.
    other = Intent(kind="drain", target="n1-w0", target_kind="worker", requested_at=1.0,
                   requested_by="ops@ctl")
    current[0] = view(workers=(worker("n1-w0"), worker("n2-w0")), intents=(other,))
    assert readiness.reason() is None
    current[0] = serving
    assert readiness.document() == (200, {"node": "n1", "ready": True, "phase": "serving"})
    before = readiness.admitting
    readiness.drain()
    status, doc = readiness.document()
    assert before and not readiness.admitting
    assert status == 503 and doc["phase"] == "draining"
    readiness.stop()
    assert readiness.document()[1]["reason"] == "lumend is stopping its engines"
