"""`lumenctl` as operators run it (a subprocess, no TTY) against a real cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from lumenctl.localcluster import LocalCluster, free_ports
from lumend.cluster.keys import Keys

from .conftest import wait_until
from .test_coordinator import all_serving

MakeCluster = Callable[..., LocalCluster]


def lumenctl(cluster: LocalCluster | None, *args: str, endpoints: str | None = None,
             timeout: float = 30) -> subprocess.CompletedProcess[str]:
    base = [sys.executable, "-m", "lumenctl", "--config", "/nonexistent/lumend.toml"]
    if cluster is not None:
        base += ["--endpoints", ",".join(cluster.endpoints), "--cluster", cluster.cluster]
    elif endpoints is not None:
        base += ["--endpoints", endpoints]
    return subprocess.run(
        [*base, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


@pytest.fixture
def cluster(local_cluster: MakeCluster) -> Iterator[LocalCluster]:
    c = local_cluster(size=3, lease_ttl_s=3)
    # Every worker serving, not only registered: drain refuses to take a model's last
    # serving worker, and the full suite once drained node-2 while it was the only one.
    wait_until(all_serving(c), 30, "a settled cluster with every worker serving")
    yield c


def test_status_json_has_the_documented_shape(cluster: LocalCluster) -> None:
    result = lumenctl(cluster, "-o", "json", "status")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["cluster"] == cluster.cluster
    assert doc["coordinator"]["node"] in {"node-1", "node-2", "node-3"}
    assert isinstance(doc["coordinator"]["epoch"], int) and doc["coordinator"]["epoch"] > 0
    assert sorted(n["name"] for n in doc["nodes"]) == ["node-1", "node-2", "node-3"]
    for node in doc["nodes"]:
        assert {"name", "address", "state"} <= node.keys()
        assert node["state"] == "up"
    assert sorted(w["name"] for w in doc["workers"]) == ["node-1-w0", "node-2-w0", "node-3-w0"]
    for worker in doc["workers"]:
        assert {"name", "node", "state", "engines", "load", "checkpoints", "intents"} <= (
            worker.keys()
        )
        assert worker["node"] == worker["name"].removesuffix("-w0")
    assert doc["problems"] == []


def test_status_table_and_yaml_show_the_same_cluster(cluster: LocalCluster) -> None:
    table = lumenctl(cluster, "status")
    assert table.returncode == 0, table.stderr
    doc = yaml.safe_load(lumenctl(cluster, "-o", "yaml", "status").stdout.split("\n---")[0])
    leader = doc["coordinator"]["node"]
    assert f"coordinator {leader} (epoch {doc['coordinator']['epoch']})" in table.stdout
    for name in ("node-1", "node-2", "node-3", "node-1-w0", "node-3-w0"):
        assert name in table.stdout
    assert "\x1b[" not in table.stdout, "no colour when stdout is not a terminal"


def test_intents_are_written_shown_and_removed(cluster: LocalCluster) -> None:
    refused = lumenctl(cluster, "drain", "node-2")
    assert refused.returncode == 2 and "--yes" in refused.stderr

    unknown = lumenctl(cluster, "drain", "node-9", "--yes")
    assert unknown.returncode == 1 and "node-9" in unknown.stderr

    assert lumenctl(cluster, "drain", "node-2", "--yes", "--reason", "bios update").returncode == 0
    not_a_worker = lumenctl(cluster, "failover", "node-3", "--yes")
    assert not_a_worker.returncode == 1

    doc = json.loads(lumenctl(cluster, "-o", "json", "status").stdout)
    workers = {w["name"]: w for w in doc["workers"]}
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert [i["kind"] for i in nodes["node-2"]["intents"]] == ["drain"]
    assert [i["kind"] for i in workers["node-2-w0"]["intents"]] == ["drain"]
    assert nodes["node-2"]["intents"][0]["reason"] == "bios update"
    assert workers["node-1-w0"]["intents"] == []

    assert lumenctl(cluster, "undrain", "node-2").returncode == 0
    assert lumenctl(cluster, "undrain", "node-2").returncode == 1  # nothing left to remove
    doc = json.loads(lumenctl(cluster, "-o", "json", "status").stdout)
    assert doc["intents"] == []

    events = json.loads(lumenctl(cluster, "-o", "json", "events").stdout)["events"]
    kinds = [e["kind"] for e in events]
    assert "coordinator_elected" in kinds
    assert {"drain_requested", "drain_withdrawn"} <= set(kinds)


def test_checkpoints_lists_every_holder(cluster: LocalCluster) -> None:
    def every_holder() -> dict[str, Any] | None:
        # On a loaded machine a node's lease can lapse between tests and its worker record
        # is gone until it registers again (seen once): wait for the three, then check.
        result = lumenctl(cluster, "-o", "json", "checkpoints")
        assert result.returncode == 0, result.stderr
        doc: dict[str, Any] = json.loads(result.stdout)
        return doc if len(doc["holders"]) == 3 else None

    doc = wait_until(every_holder, 30, "three checkpoint holders listed")
    assert sorted(h["worker"] for h in doc["holders"]) == ["node-1-w0", "node-2-w0",
                                                           "node-3-w0"]
    assert all(h["budget_bytes"] == 1 << 30 for h in doc["holders"])
    table = lumenctl(cluster, "checkpoints")
    assert table.returncode == 0 and "node-2-w0" in table.stdout and "1.0GiB" in table.stdout


def test_malformed_values_are_reported_and_skipped(cluster: LocalCluster) -> None:
    keys = Keys(cluster.cluster)
    subprocess.run(["etcdctl", "--endpoints", cluster.endpoints[0], "put",
                    keys.worker("bogus"), "{not json"], check=True, capture_output=True)
    subprocess.run(["etcdctl", "--endpoints", cluster.endpoints[0], "put",
                    keys.root + "something/else", "{}"], check=True, capture_output=True)
    result = lumenctl(cluster, "-o", "json", "status")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    problems = {p["key"] for p in doc["problems"]}
    assert problems == {keys.worker("bogus"), keys.root + "something/else"}
    assert len(doc["workers"]) == 3
    # The daemons log the bad value once and keep running.
    wait_until(lambda: all("skipping a value" in n.log_text() for n in cluster.nodes), 10,
               "every lumend to report the malformed value")
    assert all(n.running for n in cluster.nodes)


@pytest.mark.parametrize("flag", ["--etcd-timeout", "--timeout"])  # the name, its 0.1 name
def test_etcd_unreachable_exits_3_naming_the_endpoints(flag: str) -> None:
    port_a, port_b = free_ports(2)
    endpoints = f"http://127.0.0.1:{port_a},http://127.0.0.1:{port_b}"
    result = lumenctl(None, flag, "0.5", "status", endpoints=endpoints)
    assert result.returncode == 3
    assert f"127.0.0.1:{port_a}" in result.stderr and f"127.0.0.1:{port_b}" in result.stderr
    assert "Traceback" not in result.stderr


def test_usage_errors_exit_2() -> None:
    assert lumenctl(None, "status", "--bogus").returncode == 2
    assert lumenctl(None, "-o", "xml", "status").returncode == 2
    bad = lumenctl(None, "status", endpoints="not a url")
    assert bad.returncode == 2 and "not a url" in bad.stderr
