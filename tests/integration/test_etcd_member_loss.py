"""A 3-member etcd cluster loses a member: lumend keeps its lease, heartbeats and coordinator."""

from __future__ import annotations

import time
from collections.abc import Callable

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster
from lumend.cluster.keys import Keys

from .conftest import wait_until
from .test_coordinator import raw, settled

MakeCluster = Callable[..., LocalCluster]


def test_lumend_survives_losing_an_etcd_member(local_cluster: MakeCluster) -> None:
    cluster = local_cluster(size=2, lease_ttl_s=5, etcd_members=3)
    view = wait_until(settled(cluster), 30, "a settled cluster on 3 etcd members")
    assert view.coordinator is not None
    keys = Keys(cluster.cluster)
    leases_before = {kv.key: kv.lease for kv in raw(cluster, keys.nodes)}
    assert len(leases_before) == 2

    # Every node lists this member first, so each must rotate to the others.
    cluster.etcd.members[0].kill()
    killed_at = time.time()
    time.sleep(2 * cluster.lease_ttl_s + 1)

    after = read_view(cluster.endpoints, cluster.cluster)
    leases_after = {kv.key: kv.lease for kv in raw(cluster, keys.nodes)}
    assert leases_after == leases_before, "a node lost its lease and re-registered"
    for node in after.nodes.values():
        assert node.updated_at > killed_at + cluster.lease_ttl_s, f"{node.name} stopped beating"
    assert after.coordinator is not None
    assert after.coordinator.epoch == view.coordinator.epoch, "needless re-election"
    assert all(n.running for n in cluster.nodes)
