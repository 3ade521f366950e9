"""The coordinator carries out intents through the nodes' Agent service, fenced by its epoch
(real etcd, real lumend nodes, real sim engines); `lumenctl agent NODE` asks a node's agent
directly, over mTLS with certificates made here."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lumenctl.demo import read_view
from lumenctl.localcluster import (
    EtcdCluster,
    LocalCluster,
    LumendNode,
    free_ports,
    node_config_toml,
)
from lumend.cluster.view import ClusterView
from lumend.rpc.client import AgentClient, RpcFailure
from lumend.rpc.tls import RpcTls

from ..rpc.test_tls import make_pki
from .conftest import wait_until
from .test_coordinator import metric, settled
from .test_lumenctl import lumenctl

MakeCluster = Callable[..., LocalCluster]


def with_standby(cluster: LocalCluster, name: str) -> Callable[[], ClusterView | None]:
    """A settled view in which `name` serves with an active engine and a standby."""

    def probe() -> ClusterView | None:
        view = settled(cluster)()
        worker = view.workers.get(name) if view is not None else None
        if worker is None or worker.state != "serving":
            return None
        states = sorted(e.state for e in worker.engines)
        return view if states == ["active", "standby"] else None

    return probe


def failover_events(cluster: LocalCluster, worker: str) -> list[dict[str, Any]]:
    events = json.loads(lumenctl(cluster, "-o", "json", "events", "-n", "1000").stdout)["events"]
    return [e for e in events if e["kind"] in ("failover_done", "failover_refused")
            and f"failover of {worker}" in e["message"]]


def requested_at(cluster: LocalCluster, worker: str) -> float:
    events = json.loads(lumenctl(cluster, "-o", "json", "events", "-n", "1000").stdout)["events"]
    asked = [e for e in events if e["kind"] == "failover_requested" and worker in e["message"]]
    return float(asked[-1]["at"])


def test_failover_goes_through_the_coordinators_agent_call_and_a_deposed_one_is_refused(
        local_cluster: MakeCluster) -> None:
    # Shadows on node-2 and node-3 only: at least one of them is not the coordinator.
    cluster = local_cluster(size=3, lease_ttl_s=3, shadows=0,
                            node_shadows={"node-2": 1, "node-3": 1})
    view = wait_until(settled(cluster), 60, "a settled cluster")
    assert view.coordinator is not None
    leader, epoch = view.coordinator.record.node, view.coordinator.epoch
    target_node = next(n for n in ("node-2", "node-3") if n != leader)
    worker = f"{target_node}-w0"
    view = wait_until(with_standby(cluster, worker), 90, f"{worker} with a standby")

    result = lumenctl(cluster, "failover", worker, "--yes", "--wait", timeout=90)
    assert result.returncode == 0, result.stderr
    assert f"failover of {worker}:" in result.stdout
    assert f"ordered by coordinator epoch {epoch}" in result.stdout
    node = cluster.node(target_node)
    assert metric(node, "lumen_agent_commands_total", '{command="failover"}') == 1
    assert metric(cluster.node(leader), "lumen_coordinator_orders_total",
                  '{command="failover",outcome="done"}') == 1
    assert f"Failover of {worker} ordered by coordinator epoch {epoch} (epoch checked)" in (
        node.log_text())
    assert len(failover_events(cluster, worker)) == 1
    asked_at = requested_at(cluster, worker)
    rpc = view.nodes[target_node].rpc

    async def repeat() -> None:
        client = AgentClient(rpc)
        try:
            # The same intent ordered again (a coordinator that did not see the answer):
            # the first outcome, no second switchover.
            again = await client.failover(epoch, worker, asked_at)
            assert again[0] in result.stdout
            # An intent that is not pending: nothing to do.
            with pytest.raises(RpcFailure) as gone:
                await client.failover(epoch, worker, asked_at + 1.0)
            assert gone.value.code == "NOT_FOUND" and "pending" in gone.value.details
        finally:
            await client.close()

    asyncio.run(repeat())
    assert len(failover_events(cluster, worker)) == 1

    # The coordinator stops (SIGSTOP: it holds its key until its lease expires); another
    # is elected and carries out the next intent with its own, higher epoch.
    stopped = cluster.node(leader)
    stopped.signal(signal.SIGSTOP)
    try:
        def successor() -> ClusterView | None:
            v = read_view(cluster.endpoints, cluster.cluster)
            ok = v.coordinator is not None and v.coordinator.epoch > epoch
            return v if ok else None

        after = wait_until(successor, cluster.lease_ttl_s + 20, "a new coordinator")
        assert after.coordinator is not None
        new_epoch = after.coordinator.epoch
        def standby_again() -> bool:
            w = read_view(cluster.endpoints, cluster.cluster).workers.get(worker)
            return w is not None and sorted(e.state for e in w.engines) == ["active", "standby"]

        wait_until(standby_again, 90, f"{worker} with a standby again")
        second = lumenctl(cluster, "failover", worker, "--yes", "--wait", timeout=90)
        assert second.returncode == 0, second.stderr
        assert f"ordered by coordinator epoch {new_epoch}" in second.stdout

        async def deposed() -> None:
            client = AgentClient(after.nodes[target_node].rpc)
            try:
                with pytest.raises(RpcFailure) as refused:
                    await client.failover(epoch, worker)
                assert refused.value.code == "FAILED_PRECONDITION"
                assert f"epoch {epoch}" in refused.value.details
                with pytest.raises(RpcFailure) as drain_refused:
                    await client.drain(epoch, worker)
                assert drain_refused.value.code == "FAILED_PRECONDITION"
                status = await client.status()
                assert status.stale_refused == 2 and not status.workers[0].drained
            finally:
                await client.close()

        asyncio.run(deposed())
    finally:
        stopped.signal(signal.SIGCONT)
    # The old coordinator wakes, steps down and orders nothing: two intents, two switchovers.
    wait_until(settled(cluster), cluster.lease_ttl_s + 20, "the old coordinator following")
    assert len(failover_events(cluster, worker)) == 2
    assert stopped.log_text().count(f"to fail over {worker}") == 1
    assert metric(node, "lumen_agent_commands_total", '{command="failover"}') == 3


# -- lumenctl agent over mTLS ------------------------------------------------------------


@pytest.fixture
def mtls_node(etcd: EtcdCluster, tmp_path: Path) -> Iterator[tuple[LumendNode, Path, RpcTls]]:
    """One lumend serving its control plane with mTLS; (node, its config, client files)."""
    server_tls, client_tls = make_pki(tmp_path / "pki")
    text = node_config_toml("node-1", etcd.endpoints, "mtls", free_ports(5), lease_ttl_s=3,
                            shadows=0, workdir=tmp_path)
    text = text.replace("[rpc]\n", f'[rpc]\nca = "{server_tls.ca}"\ncert = "{server_tls.cert}"\n'
                        f'key = "{server_tls.key}"\n', 1)
    config = tmp_path / "node-1.toml"
    config.write_text(text)
    node = LumendNode("node-1", config, tmp_path / "node-1.log").start()
    try:
        yield node, config, client_tls
    finally:
        node.stop()


def ctl(etcd: EtcdCluster, *args: str, config: Path | None = None,
        timeout: float = 30) -> subprocess.CompletedProcess[str]:
    base = [sys.executable, "-m", "lumenctl", "--config", str(config or "/nonexistent.toml"),
            "--endpoints", ",".join(etcd.endpoints), "--cluster", "mtls"]
    return subprocess.run([*base, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_lumenctl_agent_shows_a_nodes_live_status_over_mtls(
        etcd: EtcdCluster, mtls_node: tuple[LumendNode, Path, RpcTls], tmp_path: Path) -> None:
    node, config, client = mtls_node

    def serving() -> ClusterView | None:
        v = read_view(etcd.endpoints, "mtls")
        w = v.workers.get("node-1-w0")
        return v if v.coordinator is not None and w is not None and w.state == "serving" else None

    wait_until(serving, 60, "node-1-w0 serving")
    # The node config's [rpc] certificates (the node's own, signed by the CA).
    table = ctl(etcd, "agent", "node-1", config=config)
    assert table.returncode == 0, table.stderr
    assert "node node-1 (live" in table.stdout and "mTLS" in table.stdout
    assert "node-1-w0" in table.stdout and "serving" in table.stdout
    flags = ["--rpc-ca", client.ca, "--rpc-cert", client.cert, "--rpc-key", client.key]
    doc = json.loads(ctl(etcd, "-o", "json", "agent", "node-1", *flags).stdout)
    assert doc["node"] == "node-1" and doc["tls"] is True and doc["highest_epoch"] > 0
    assert [w["name"] for w in doc["workers"]] == ["node-1-w0"]
    assert doc["workers"][0]["drained"] is False

    # The coordinator's Drain order reaches the node over mTLS, and the agent shows it
    # (the only serving worker of its model: --force).
    drained = ctl(etcd, "drain", "node-1", "--yes", "--force", "--wait", "--wait-timeout", "30")
    assert drained.returncode == 0, drained.stderr
    doc = json.loads(ctl(etcd, "-o", "json", "agent", "node-1", *flags).stdout)
    assert doc["workers"][0]["drained"] is True and doc["workers"][0]["state"] == "drained"
    assert ctl(etcd, "undrain", "node-1").returncode == 0

    def undrained() -> bool:
        d = json.loads(ctl(etcd, "-o", "json", "agent", "node-1", *flags).stdout)
        return d["workers"][0]["drained"] is False and d["workers"][0]["state"] == "serving"

    wait_until(undrained, 20, "node-1-w0 undrained by the coordinator")

    # Negative controls: no client certificate, a certificate of another CA, half the
    # flags, an unknown node, a node that does not answer.
    plain = ctl(etcd, "agent", "node-1")
    assert plain.returncode == 1
    assert "refused lumenctl without a client certificate" in plain.stderr, plain.stderr
    _, stranger = make_pki(tmp_path / "other-pki")
    foreign = ctl(etcd, "agent", "node-1", "--rpc-ca", stranger.ca, "--rpc-cert",
                  stranger.cert, "--rpc-key", stranger.key)
    assert foreign.returncode == 1 and "TLS handshake failed" in foreign.stderr, foreign.stderr
    half = ctl(etcd, "agent", "node-1", "--rpc-ca", client.ca)
    assert half.returncode == 2 and "--rpc-cert, --rpc-key missing" in half.stderr
    unknown = ctl(etcd, "agent", "node-9", *flags)
    assert unknown.returncode == 1 and "no node named 'node-9'" in unknown.stderr
    node.signal(signal.SIGSTOP)
    try:
        hung = ctl(etcd, "agent", "node-1", *flags, "--rpc-timeout", "1")
    finally:
        node.signal(signal.SIGCONT)
    assert hung.returncode == 1 and "nothing answered there within 1 s" in hung.stderr, (
        hung.stderr)
