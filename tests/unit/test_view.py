"""Decoding the cluster from a snapshot: typed values, foreign and malformed ones skipped."""

from __future__ import annotations

import json

from lumenctl.report import status_document
from lumend.cluster.keys import Keys
from lumend.cluster.models import (
    CoordinatorRecord,
    Intent,
    NodeRecord,
    WorkerRecord,
    encode_value,
)
from lumend.cluster.store import KeyValue, Snapshot
from lumend.cluster.view import build_view

KEYS = Keys("prod")


def kv(key: str, value: bytes, create: int = 1, lease: int = 0) -> KeyValue:
    return KeyValue(key, value, create, create, lease)


def node(name: str) -> NodeRecord:
    return NodeRecord(name=name, address="10.0.0.1", pid=1, version="0", started_at=0,
                      updated_at=0, gateway="g", rpc="r", checkpoint="c", metrics="m",
                      workers=[f"{name}-w0"])


def worker(name: str, node_name: str) -> WorkerRecord:
    return WorkerRecord(name=name, node=node_name, gpus=[0], engine="sim", model="m",
                        state="serving", updated_at=0)


def test_view_decodes_every_kind_and_skips_bad_values() -> None:
    coordinator = CoordinatorRecord(node="n1", address="a", rpc="r", elected_at=0)
    intent = Intent(kind="drain", target="n1", target_kind="node", requested_at=0,
                    requested_by="op")
    snapshot = Snapshot(
        [
            kv(KEYS.node("n1"), encode_value(node("n1"))),
            kv(KEYS.worker("n1-w0"), encode_value(worker("n1-w0", "n1"))),
            kv(KEYS.coordinator, encode_value(coordinator), create=41, lease=7),
            kv(KEYS.intent("drain", "n1"), encode_value(intent)),
            kv(KEYS.worker("broken"), b"{not json"),
            kv(KEYS.worker("liar"), encode_value(worker("other", "n1"))),
            kv(KEYS.node("n2"), json.dumps({"name": "n2"}).encode()),  # fields missing
            kv(KEYS.root + "foreign/thing", b"{}"),
        ],
        revision=50,
    )
    view = build_view(KEYS, snapshot)
    assert list(view.nodes) == ["n1"]
    assert list(view.workers) == ["n1-w0"]
    assert view.coordinator is not None
    assert (view.coordinator.record.node, view.coordinator.epoch, view.coordinator.lease) == (
        "n1", 41, 7)
    assert [i.target for i in view.intents] == ["n1"]
    bad = {p.key: p.reason for p in view.problems}
    assert set(bad) == {KEYS.worker("broken"), KEYS.worker("liar"), KEYS.node("n2"),
                        KEYS.root + "foreign/thing"}
    assert "not a valid NodeRecord" in bad[KEYS.node("n2")]
    assert "names worker 'other'" in bad[KEYS.worker("liar")]

    doc = status_document(view)
    assert doc["coordinator"]["epoch"] == 41
    # A node's drain shows on the node and on each of its workers.
    assert [i["kind"] for i in doc["nodes"][0]["intents"]] == ["drain"]
    assert [i["kind"] for i in doc["workers"][0]["intents"]] == ["drain"]
    assert len(doc["problems"]) == 4


def test_empty_cluster_has_no_coordinator() -> None:
    view = build_view(KEYS, Snapshot([], revision=1))
    doc = status_document(view)
    assert doc["coordinator"] is None and doc["nodes"] == [] and doc["workers"] == []


def test_event_keys_sort_by_time() -> None:
    assert KEYS.event(999, "b", 1) < KEYS.event(1000, "a", 0)


def test_checkpoints_document_reports_fill_and_balance() -> None:
    from lumenctl.report import checkpoints_document
    from lumend.cluster.models import CheckpointUsage

    def holder(name: str, held: int, budget: int, requests: int) -> WorkerRecord:
        return msgspec_replace(worker(name, "n1"), CheckpointUsage(
            bytes_held=held, budget_bytes=budget, requests=requests))

    snapshot = Snapshot([
        kv(KEYS.worker("a"), encode_value(holder("a", 300, 1000, 3))),
        kv(KEYS.worker("b"), encode_value(holder("b", 100, 1000, 1))),
        kv(KEYS.worker("c"), encode_value(holder("c", 0, 0, 0))),  # holds none by config
    ], revision=2)
    doc = checkpoints_document(build_view(KEYS, snapshot))
    assert [h["worker"] for h in doc["holders"]] == ["a", "b", "c"]
    assert doc["holders"][0]["fill"] == 0.3 and doc["holders"][2]["fill"] is None
    assert doc["bytes_held"] == 400 and doc["requests"] == 4
    assert doc["balance_ratio"] == 3.0  # c has no budget, so it does not count
    empty = Snapshot([kv(KEYS.worker("a"), encode_value(holder("a", 0, 1000, 0)))], revision=3)
    assert checkpoints_document(build_view(KEYS, empty))["balance_ratio"] is None


def msgspec_replace(record: WorkerRecord, usage: object) -> WorkerRecord:
    import msgspec

    return msgspec.structs.replace(record, checkpoints=usage)
