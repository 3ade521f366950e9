"""The epoch fence cannot be poisoned: an Agent command carrying an epoch no coordinator was
elected with is refused, leaves the node's highest epoch where it was, and the real
coordinator's orders still work (real etcd, real lumend nodes, real sim engines). An order
that names no intent (`requested_at` 0) switches nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from lumenctl.localcluster import LocalCluster
from lumend.rpc.client import AgentClient, RpcFailure

from .conftest import wait_until
from .test_agent_commands import failover_events, with_standby
from .test_coordinator import metric, settled
from .test_lumenctl import lumenctl

MakeCluster = Callable[..., LocalCluster]


def test_a_forged_epoch_is_refused_and_failover_still_works(local_cluster: MakeCluster) -> None:
    cluster = local_cluster(size=2, lease_ttl_s=3, shadows=0,
                            node_shadows={"node-1": 1, "node-2": 1})
    view = wait_until(settled(cluster), 60, "a settled cluster")
    assert view.coordinator is not None
    epoch = view.coordinator.epoch
    target = next(n for n in ("node-1", "node-2") if n != view.coordinator.record.node)
    worker = f"{target}-w0"
    view = wait_until(with_standby(cluster, worker), 90, f"{worker} with a standby")
    rpc = view.nodes[target].rpc

    async def poison() -> None:
        client = AgentClient(rpc)
        try:
            for forged in (2**62, epoch + 10_000):
                with pytest.raises(RpcFailure) as refused:
                    await client.drain(forged, worker)
                assert refused.value.code == "FAILED_PRECONDITION"
                assert "not the current coordinator's epoch" in refused.value.details
            status = await client.status()
            assert status.highest_epoch == epoch, "a forged epoch raised the bar"
            assert not status.workers[0].drained
            # The current coordinator's epoch, but no intent named: nothing to claim, so
            # nothing is switched.
            with pytest.raises(RpcFailure) as unnamed:
                await client.failover(epoch, worker)
            assert unnamed.value.code == "NOT_FOUND" and "names no intent" in (
                unnamed.value.details)
        finally:
            await client.close()

    asyncio.run(poison())
    node = cluster.node(target)
    assert node.log_text().count("not the current coordinator's epoch") >= 2
    assert metric(node, "lumen_agent_unconfirmed_epoch_refused_total") == 2
    assert metric(node, "lumen_agent_stale_epoch_refused_total") == 0
    assert failover_events(cluster, worker) == []
    # The real coordinator's order is still obeyed (before the fix: refused as stale
    # against the forged 2**62, and `--wait` timed out).
    result = lumenctl(cluster, "failover", worker, "--yes", "--wait", "--wait-timeout", "45",
                      timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ordered by coordinator epoch {epoch}" in result.stdout
    assert len(failover_events(cluster, worker)) == 1
