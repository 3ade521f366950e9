"""lumend supervising sim engines: what etcd and lumenctl show, planned and unplanned
failover of a worker's active engine."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lumenctl.localcluster import LocalCluster

from .conftest import wait_until
from .test_lumenctl import lumenctl

MakeCluster = Callable[..., LocalCluster]


def status(cluster: LocalCluster) -> dict[str, Any]:
    result = lumenctl(cluster, "-o", "json", "status")
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def whole_worker(cluster: LocalCluster, name: str) -> Callable[[], dict[str, Any] | None]:
    """The worker's record once it serves with one active engine and one standby."""

    def probe() -> dict[str, Any] | None:
        workers = {w["name"]: w for w in status(cluster)["workers"]}
        worker = workers.get(name)
        if worker is None or worker["state"] != "serving":
            return None
        states = sorted(e["state"] for e in worker["engines"])
        return worker if states == ["active", "standby"] else None

    return probe


@pytest.fixture
def cluster(local_cluster: MakeCluster) -> Iterator[LocalCluster]:
    c = local_cluster(size=2, lease_ttl_s=3)
    for node in ("node-1", "node-2"):
        wait_until(whole_worker(c, f"{node}-w0"), 60, f"{node}-w0 serving with a standby")
    yield c


def test_status_lists_each_engine(cluster: LocalCluster) -> None:
    worker = whole_worker(cluster, "node-1-w0")()
    assert worker is not None
    engines = {e["id"]: e for e in worker["engines"]}
    assert sorted(engines) == ["node-1-w0/0", "node-1-w0/1"]
    roles = sorted(e["role"] for e in engines.values())
    assert roles == ["active", "shadow"]
    for engine in engines.values():
        assert engine["pid"] > 0 and engine["url"].startswith("http://127.0.0.1:")
    table = lumenctl(cluster, "status").stdout
    assert "0:active" in table or "1:active" in table


def test_sigkill_of_the_active_engine_is_shown_and_healed(cluster: LocalCluster) -> None:
    before = whole_worker(cluster, "node-1-w0")()
    assert before is not None
    active = next(e for e in before["engines"] if e["role"] == "active")
    os.kill(active["pid"], signal.SIGKILL)

    def healed() -> dict[str, Any] | None:
        worker = whole_worker(cluster, "node-1-w0")()
        if worker is None:
            return None
        pids = {e["pid"] for e in worker["engines"]}
        return worker if active["pid"] not in pids else None

    after = wait_until(healed, 60, "another engine active and a new shadow")
    now_active = next(e for e in after["engines"] if e["role"] == "active")
    # (That the shadow, not the restarted engine, takes over is tests/failover's to show,
    # where the supervisor's own state is read without the etcd heartbeat in between.)
    assert now_active["pid"] != active["pid"]


def test_planned_failover_waits_and_reports(cluster: LocalCluster) -> None:
    before = whole_worker(cluster, "node-2-w0")()
    assert before is not None
    old = next(e["id"] for e in before["engines"] if e["role"] == "active")
    result = lumenctl(cluster, "failover", "node-2-w0", "--yes", "--wait", timeout=90)
    assert result.returncode == 0, result.stderr
    assert "failover of node-2-w0:" in result.stdout and "active" in result.stdout

    def switched() -> str | None:
        worker = whole_worker(cluster, "node-2-w0")()
        if worker is None:
            return None
        active = next(e["id"] for e in worker["engines"] if e["role"] == "active")
        return active if active != old else None

    new = wait_until(switched, 30, "another engine of node-2-w0 active, the old one standing by")
    assert f"{new} active" in result.stdout
    assert status(cluster)["intents"] == [], "the node removes the intent it carried out"
    events = json.loads(lumenctl(cluster, "-o", "json", "events").stdout)["events"]
    assert any(e["kind"] == "failover_done" and "node-2-w0" in e["message"] for e in events)


def test_engines_die_with_their_lumend(cluster: LocalCluster) -> None:
    worker = whole_worker(cluster, "node-2-w0")()
    assert worker is not None
    pids = [e["pid"] for e in worker["engines"]]
    cluster.node("node-2").kill()  # SIGKILL: lumend cannot stop them itself

    def gone() -> bool:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        return not alive

    wait_until(gone, 15, "the engines of a SIGKILLed lumend to die with it")
    # A lumend started again finds the ports and the failover lock free.
    cluster.node("node-2").start()
    wait_until(whole_worker(cluster, "node-2-w0"), 60, "node-2-w0 whole under the new lumend")
