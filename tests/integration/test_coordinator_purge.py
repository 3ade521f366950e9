"""The coordinator forgets the requests of a gateway that died mid-stream (issue 14 item 6):
real etcd, three real lumend processes with sim engines, streams through one node's
gateway, SIGKILL of that node. Its requests never get a Finish; once its node record is
gone from etcd the coordinator drops them and L_hat is back to the heartbeats'."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import aiohttp
import pytest

from lumenctl.localcluster import LocalCluster

from ..gateway.test_gateway import Streams
from .conftest import wait_until
from .test_coordinator import all_serving, caught_up, coordinator_client, metric

pytestmark = pytest.mark.etcd

MakeCluster = Callable[..., LocalCluster]


def test_a_dead_gateways_requests_are_forgotten(local_cluster: MakeCluster) -> None:
    cluster = local_cluster(size=3, lease_ttl_s=3, shadows=0,
                            engine_args=("--time-scale", "4.0"))
    view = wait_until(all_serving(cluster), 60, "3 serving workers")
    assert view.coordinator is not None
    leader = cluster.node(view.coordinator.record.node)
    doomed = cluster.node(next(n for n in view.nodes if n != leader.name))
    survivors = sorted(w for w in view.workers if not w.startswith(doomed.name + "-"))

    async def scenario() -> None:
        client = coordinator_client(view)
        try:
            await caught_up(client, 3)
        finally:
            await client.close()
        async with aiohttp.ClientSession() as session:
            streams = await Streams.start(session, doomed.gateway,
                                          "stream {} outlives its gateway")
            # Control: the coordinator counts them while they stream.
            assert metric(leader, "lumen_coordinator_requests") >= len(streams.prompts)
            doomed.kill()
            await asyncio.gather(*streams.tasks, return_exceptions=True)

    asyncio.run(scenario())
    wait_until(lambda: metric(leader, "lumen_coordinator_requests") == 0,
               cluster.lease_ttl_s + 15, "the coordinator to forget the dead gateway's requests")

    async def loads() -> list[str]:
        client = coordinator_client(view)
        try:
            reasons = [(await client.admit(f"after-{i}", None, "test")).reason
                       for i in range(len(survivors))]
            for i in range(len(survivors)):
                await client.finish(f"after-{i}")
            return reasons
        finally:
            await client.close()

    # Each survivor is admitted to with an empty queue again (cost-aware admission, the
    # default, names the queue it chose by): nothing of the dead gateway is left.
    def back_to_normal() -> list[str] | None:
        reasons = asyncio.run(loads())
        lows = [re.search(r"queue (\d+), the shortest", r) for r in reasons]
        return reasons if all(m is not None and int(m.group(1)) == 0 for m in lows) else None

    wait_until(back_to_normal, 15, "both survivors idle in the coordinator's L_hat")
