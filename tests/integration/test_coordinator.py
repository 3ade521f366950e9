"""A cluster of real lumend processes on one real etcd: election, takeover, fencing, handover."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster
from lumend.cluster.keys import Keys
from lumend.cluster.models import Event, decode_value
from lumend.cluster.store import EtcdStore, KeyValue
from lumend.cluster.view import ClusterView

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
