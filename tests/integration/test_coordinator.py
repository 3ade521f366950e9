"""A cluster of real lumend processes on one real etcd: election, takeover, fencing, handover;
the Coordinator and Agent services they serve, and the gateway's use of them."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable

import aiohttp
import pytest

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster, LumendNode
from lumend.cluster.keys import Keys
from lumend.cluster.models import Event, decode_value
from lumend.cluster.store import EtcdStore, KeyValue
from lumend.cluster.view import ClusterView
from lumend.rpc.client import AgentClient, CoordinatorClient, RpcFailure
from lumend.rpc.messages import Admission, RecoverAsk, Recovery

from ..gateway.test_gateway import Streams
from .conftest import wait_until

MakeCluster = Callable[..., LocalCluster]


def settled(cluster: LocalCluster) -> Callable[[], ClusterView | None]:
    """A view in which every node is registered and agrees on one coordinator."""

    def probe() -> ClusterView | None:
        view = read_view(cluster.endpoints, cluster.cluster)
        running = {n.name for n in cluster.nodes if n.running}
        if set(view.nodes) != running or view.coordinator is None:
            return None
        epoch = view.coordinator.epoch
        leader = view.coordinator.record.node
        for node in view.nodes.values():
            expected = (
                f"coordinating as {leader} (epoch {epoch})"
                if node.name == leader
                else f"following coordinator {leader} (epoch {epoch})"
            )
            if not node.status.startswith(expected):
                return None
        return view

    return probe


def raw(cluster: LocalCluster, prefix: str) -> list[KeyValue]:
    async def go() -> list[KeyValue]:
        store = EtcdStore(cluster.endpoints)
        try:
            return (await store.get_prefix(prefix)).kvs
        finally:
            await store.close()

    return asyncio.run(go())


def test_exactly_one_coordinator(local_cluster: MakeCluster) -> None:
    cluster = local_cluster(size=3, lease_ttl_s=3)
    view = wait_until(settled(cluster), 20, "3 nodes agreeing on one coordinator")
    assert view.coordinator is not None
    coordinating = [n for n in view.nodes.values() if n.status.startswith("coordinating")]
    assert [n.name for n in coordinating] == [view.coordinator.record.node]
    assert len(view.workers) == 3
    # The term is stable: no spurious re-elections while nothing fails.
    time.sleep(2 * cluster.lease_ttl_s)
    later = read_view(cluster.endpoints, cluster.cluster)
    assert later.coordinator is not None
    assert later.coordinator.epoch == view.coordinator.epoch


def test_sigkill_coordinator_another_takes_over_with_higher_epoch(
    local_cluster: MakeCluster,
) -> None:
    cluster = local_cluster(size=3, lease_ttl_s=3)
    view = wait_until(settled(cluster), 20, "a settled cluster")
    assert view.coordinator is not None
    victim, epoch = view.coordinator.record.node, view.coordinator.epoch

    cluster.node(victim).kill()

    def new_term() -> ClusterView | None:
        v = read_view(cluster.endpoints, cluster.cluster)
        return v if v.coordinator is not None and v.coordinator.epoch > epoch else None

    after = wait_until(new_term, cluster.lease_ttl_s + 5, "a new coordinator after SIGKILL")
    assert after.coordinator is not None
    assert after.coordinator.record.node != victim
    gone = wait_until(settled(cluster), 20, "the survivors to agree")
    assert victim not in gone.nodes


def test_paused_coordinator_cannot_write_and_steps_down(local_cluster: MakeCluster) -> None:
    cluster = local_cluster(size=3, lease_ttl_s=3)
    view = wait_until(settled(cluster), 20, "a settled cluster")
    assert view.coordinator is not None
    paused_name, old_epoch = view.coordinator.record.node, view.coordinator.epoch
    paused = cluster.node(paused_name)

    paused.signal(signal.SIGSTOP)
    try:
        def new_term() -> ClusterView | None:
            v = read_view(cluster.endpoints, cluster.cluster)
            return v if v.coordinator is not None and v.coordinator.epoch > old_epoch else None

        after = wait_until(new_term, cluster.lease_ttl_s + 5, "a takeover while paused")
        assert after.coordinator is not None
        new_epoch = after.coordinator.epoch
        takeover_revision = after.revision
        time.sleep(1.0)  # let the paused node's lease be well past its TTL
    finally:
        paused.signal(signal.SIGCONT)

    # It wakes up believing it is coordinator; it must step down and rejoin as a follower.
    wait_until(lambda: "stepped down as coordinator" in paused.log_text(), 15,
               f"{paused_name} to log that it stepped down")
    rejoined = wait_until(settled(cluster), 20, f"{paused_name} to rejoin as a follower")
    assert rejoined.coordinator is not None
    assert rejoined.coordinator.epoch == new_epoch
    assert rejoined.nodes[paused_name].status.startswith("following")

    # Nothing was written under the old epoch after the takeover.
    keys = Keys(cluster.cluster)
    status = raw(cluster, keys.coordinator_status)
    assert status and b'"epoch":%d' % new_epoch in status[0].value
    for kv in raw(cluster, keys.events):
        event = decode_value(kv.value, Event)
        if event.epoch == old_epoch:
            assert kv.mod_revision <= takeover_revision, f"stale write after takeover: {event}"


def test_graceful_stop_hands_over_without_waiting_for_the_lease(
    local_cluster: MakeCluster,
) -> None:
    ttl = 15  # long, so that a handover which waited for the lease would time out below
    cluster = local_cluster(size=3, lease_ttl_s=ttl)
    view = wait_until(settled(cluster), 30, "a settled cluster")
    assert view.coordinator is not None
    leader, epoch = view.coordinator.record.node, view.coordinator.epoch

    assert cluster.node(leader).stop() == 0

    def new_term() -> ClusterView | None:
        v = read_view(cluster.endpoints, cluster.cluster)
        return v if v.coordinator is not None and v.coordinator.epoch > epoch else None

    after = wait_until(new_term, ttl - 5, "a handover before the old lease could expire")
    assert after.coordinator is not None and after.coordinator.record.node != leader
    assert leader not in after.nodes, "a stopped node deregisters at once"
    kinds = [(e.kind, e.source) for e in after.events]
    assert ("coordinator_resigned", leader) in kinds


# -- the control plane: Coordinator and Agent services of real lumend processes ----------

def node_addresses(node: LumendNode) -> dict[str, str]:
    """rpc and metrics host:port of a local node, from its config file."""
    config = tomllib.loads(node.config_path.read_text())
    return {"rpc": config["rpc"]["listen"], "metrics": config["metrics"]["listen"]}


def metric(node: LumendNode, name: str, labels: str = "") -> float:
    url = f"http://{node_addresses(node)['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f"{name}{labels} "):
                return float(line.split()[1])
    return 0.0


def all_serving(cluster: LocalCluster) -> Callable[[], ClusterView | None]:
    def probe() -> ClusterView | None:
        view = settled(cluster)()
        if view is None or len(view.workers) != len(view.nodes):
            return None
        return view if all(w.state == "serving" for w in view.workers.values()) else None

    return probe


def coordinator_client(view: ClusterView) -> CoordinatorClient:
    assert view.coordinator is not None
    return CoordinatorClient(view.coordinator.record.rpc)


async def caught_up(client: CoordinatorClient, workers: int, timeout_s: float = 10.0,
                    with_checkpoint: bool = False, policy: str | None = None) -> None:
    """Wait until the coordinator's own view (read once per HA cycle, so up to a cycle behind
    what a test read from etcd) sees `workers` serving: probe admissions until they have gone
    to as many different workers (`with_checkpoint`: each with a checkpoint, so the holders'
    budgets are seen too; `policy`: each decided under that mode, which the coordinator also
    reads once a cycle). The probes are finished however it ends."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    n = 0
    last = ""
    try:
        while len(seen) < workers:
            assert time.monotonic() < deadline, (
                f"the coordinator's view did not catch up: admissions went to {sorted(seen)} "
                f"of {workers} workers (last: {last})")
            admission = await client.admit(f"probe-{n}", None, "test")
            n += 1
            last = f"{admission.policy}: {admission.reason}"
            if policy is not None and admission.policy != policy:
                seen.clear()
            elif admission.target is not None and (admission.checkpoint is not None
                                                   or not with_checkpoint):
                seen.add(admission.target.worker)
            await asyncio.sleep(0.05)
    finally:
        for i in range(n):
            await client.finish(f"probe-{i}")


def test_admit_and_recover_are_served_by_the_elected_coordinator(
    local_cluster: MakeCluster,
) -> None:
    cluster = local_cluster(size=3, lease_ttl_s=3, shadows=0)
    view = wait_until(all_serving(cluster), 60, "3 serving workers and one coordinator")
    assert view.coordinator is not None
    leader, epoch = view.coordinator.record.node, view.coordinator.epoch

    async def scenario() -> None:
        client = coordinator_client(view)
        follower_name = next(n for n in view.nodes if n != leader)
        follower = CoordinatorClient(view.nodes[follower_name].rpc)
        try:
            await caught_up(client, 3)
            admission = await client.admit("req-1", "sim-small", "test")
            assert admission.epoch == epoch and admission.policy == "lumen"
            assert admission.target is not None and admission.checkpoint is not None
            serving = view.workers[admission.target.worker]
            holder = view.workers[admission.checkpoint.holder]
            assert holder.node != serving.node, "Algorithm 1 prefers a holder on another node"
            assert admission.checkpoint.endpoint == "tcp://" + view.nodes[holder.node].checkpoint
            # The queue counts: the next admission goes to another worker.
            second = await client.admit("req-2", "sim-small", "test")
            assert second.target is not None
            assert second.target.worker != admission.target.worker
            # Recover: the prefix is long (4096 tokens: 0.4 s to recompute, by the cost
            # model), so resume at the holder even with req-2 queued there (0.12 s).
            ask = RecoverAsk("req-1", serving.name, 4096, "sim-small", admission.checkpoint,
                             "test")
            recovery = await client.recover(ask)
            assert recovery.epoch == epoch and recovery.resume, recovery.reason
            assert recovery.target is not None and recovery.target.worker == holder.name
            assert f"resume on {holder.name}" in recovery.reason
            assert (await client.finish("req-1"))[1] is True
            assert (await client.finish("req-1"))[1] is False
            # Negative control: a node that is not the coordinator refuses and names it.
            with pytest.raises(RpcFailure) as refused:
                await follower.admit("req-3", None, "test")
            assert refused.value.code == "UNAVAILABLE"
            assert f"{leader} (epoch {epoch})" in refused.value.details
        finally:
            await client.close()
            await follower.close()

    asyncio.run(scenario())


def test_agent_refuses_a_deposed_coordinators_epoch(local_cluster: MakeCluster) -> None:
    cluster = local_cluster(size=3, lease_ttl_s=3, shadows=0)
    view = wait_until(all_serving(cluster), 60, "a settled cluster")
    assert view.coordinator is not None
    old_leader, old_epoch = view.coordinator.record.node, view.coordinator.epoch
    cluster.node(old_leader).kill()
    after = wait_until(settled(cluster), cluster.lease_ttl_s + 15, "a new coordinator")
    assert after.coordinator is not None and after.coordinator.epoch > old_epoch
    new_epoch = after.coordinator.epoch
    target = next(n for n in after.nodes if n != after.coordinator.record.node)

    async def scenario() -> None:
        agent = AgentClient(after.nodes[target].rpc)
        try:
            status = await agent.status()
            assert status.node == target and status.highest_epoch == new_epoch
            with pytest.raises(RpcFailure) as refused:
                await agent.drain(old_epoch, target)
            assert refused.value.code == "FAILED_PRECONDITION"
            assert f"epoch {old_epoch}" in refused.value.details
            assert f"epoch {new_epoch}" in refused.value.details
            assert (await agent.status()).stale_refused == 1
            # Negative control: the current coordinator's epoch is obeyed.
            drained, _ = await agent.drain(new_epoch, target)
            assert drained == [f"{target}-w0"]
            status = await agent.status()
            assert status.workers[0].drained and status.stale_refused == 1
            undrained, _ = await agent.drain(new_epoch, target, undo=True)
            assert undrained == []
        finally:
            await agent.close()

    asyncio.run(scenario())
    assert metric(cluster.node(target), "lumen_agent_stale_epoch_refused_total") == 1


def test_config_set_reaches_the_coordinators_next_decision(local_cluster: MakeCluster) -> None:
    cluster = local_cluster(size=2, lease_ttl_s=3, shadows=0)
    view = wait_until(all_serving(cluster), 60, "2 serving workers")

    def lumenctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "lumenctl", "--config", "/nonexistent/lumend.toml",
             "--endpoints", ",".join(cluster.endpoints), "--cluster", cluster.cluster, *args],
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)

    async def decide(client: CoordinatorClient, n: int) -> tuple[Admission, Recovery]:
        """Admit a request, then another (it goes to the other worker, the holder, whose
        L_hat becomes 1), and recover the first from the failure of its worker."""
        admission = await client.admit(f"r{n}", None, "test")
        assert admission.target is not None
        await client.admit(f"load{n}", None, "test")
        recovery = await client.recover(RecoverAsk(
            f"r{n}", admission.target.worker, 64, "", admission.checkpoint, "test"))
        await client.finish(f"r{n}")
        await client.finish(f"load{n}")
        return admission, recovery

    async def scenario() -> None:
        client = coordinator_client(view)
        try:
            await caught_up(client, 2)
            admission, recovery = await decide(client, 0)
            assert admission.checkpoint is not None and recovery.resume  # the defaults
            assert "the shortest" in admission.reason  # decisions cost_aware, the default
            # The paper's decisions, theta 0, and a prefix (4 blocks) not above tau: the
            # holder (L_hat 1) is overloaded, so the request is recomputed instead.
            assert lumenctl("config", "set", "decisions", "paper", "--yes").returncode == 0
            assert lumenctl("config", "set", "theta", "0", "--yes").returncode == 0
            deadline = time.monotonic() + 10
            n = 1
            while (await decide(client, n))[1].resume:
                assert time.monotonic() < deadline, "theta = 0 never reached the coordinator"
                n += 1
                await asyncio.sleep(0.05)
            assert lumenctl("config", "set", "mode", "stop_and_restart", "--yes").returncode == 0
            while (await decide(client, n))[0].policy != "stop_and_restart":
                assert time.monotonic() < deadline, "the mode never reached the coordinator"
                n += 1
                await asyncio.sleep(0.05)
            admission, _ = await decide(client, n + 1)
            assert admission.checkpoint is None, "stop_and_restart places no checkpoint"
        finally:
            await client.close()

    asyncio.run(scenario())
    shown = lumenctl("-o", "json", "config", "show")
    assert shown.returncode == 0
    settings = {row["key"]: row["value"] for row in json.loads(shown.stdout)["settings"]}
    assert settings["theta"] == 0 and settings["mode"] == "stop_and_restart"
    assert settings["decisions"] == "paper"
    assert lumenctl("config", "get", "tau").stdout.strip() == "64"
    bad = lumenctl("config", "set", "theta", "lots", "--yes")
    assert bad.returncode == 2 and "theta 'lots' is not a number" in bad.stderr
    assert lumenctl("config", "set", "gamma", "1", "--yes").returncode == 2


def test_gateway_decides_locally_when_the_coordinator_is_gone(
    local_cluster: MakeCluster,
) -> None:
    cluster = local_cluster(size=3, lease_ttl_s=3, shadows=0)
    view = wait_until(all_serving(cluster), 60, "a settled cluster")
    assert view.coordinator is not None
    leader = view.coordinator.record.node
    gateway_node = cluster.node(next(n for n in view.nodes if n != leader))
    body = json.dumps({"prompt": "hello there", "max_tokens": 5}).encode()

    def complete() -> str:
        request = urllib.request.Request(gateway_node.gateway + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            return str(json.loads(r.read())["choices"][0]["text"])

    coordinated = 'lumen_gateway_coordinated_total{call="admit"}'
    degraded = 'lumen_gateway_degraded_total{call="admit"}'
    wait_until(lambda: complete() and metric(gateway_node, coordinated), 20,
               "an admission by the coordinator")
    # Negative control: with the coordinator there, nothing was decided locally.
    assert metric(gateway_node, degraded) == 0
    text = complete()
    cluster.node(leader).signal(signal.SIGSTOP)  # it holds its key but cannot answer
    try:
        assert complete() == text
        assert metric(gateway_node, degraded) >= 1
    finally:
        cluster.node(leader).signal(signal.SIGCONT)
    assert "coordinator unavailable" in gateway_node.log_text()


def test_streams_complete_when_the_coordinator_dies_during_their_recovery(
    local_cluster: MakeCluster,
) -> None:
    cluster = local_cluster(size=3, lease_ttl_s=3, shadows=0,
                            engine_args=("--time-scale", "2.0"))
    view = wait_until(all_serving(cluster), 60, "3 serving workers")
    assert view.coordinator is not None
    leader = view.coordinator.record.node
    gateway_node = cluster.node(next(n for n in view.nodes if n != leader))

    victim = view.workers[f"{leader}-w0"].engines[0].url

    async def scenario() -> None:
        client = coordinator_client(view)
        try:
            await caught_up(client, 3)  # so that the coordinator spreads the streams over all
        finally:
            await client.close()
        async with aiohttp.ClientSession() as session:
            streams = await Streams.start(session, gateway_node.gateway,
                                          "stream {} meets a dying coordinator")
            async with session.get(victim + "/lumen/engine") as r:
                assert (await r.json())["running"] > 0, "no stream on the victim"
            # SIGKILL the coordinator's lumend: its engines die with it (their lifeline), so
            # streams break and ask to be recovered while no coordinator answers.
            cluster.node(leader).kill()
            await streams.check_against_failure_free()

    asyncio.run(scenario())
    log = gateway_node.log_text()
    assert "resuming request" in log, "no stream was interrupted: the test is void"
    assert metric(gateway_node, "lumen_gateway_recover_coordinator_changes_total") >= 1, (
        "no recovery was answered by the newly elected coordinator")
