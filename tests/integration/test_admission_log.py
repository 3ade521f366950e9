"""`[gateway] log_admissions` on real lumend nodes: one line per request, decided by the
coordinator, naming the id the client saw; turned off live by a reload (SIGHUP)."""

from __future__ import annotations

import asyncio
import signal

import aiohttp

from lumenctl.admissions import first_admissions, read_admissions
from lumenctl.localcluster import LocalCluster, LumendNode

from .conftest import wait_until
from .test_coordinator import MakeCluster, all_serving, caught_up, coordinator_client


async def completion_ids(gateway: str, count: int) -> list[str]:
    async with aiohttp.ClientSession() as session:
        ids = []
        for i in range(count):
            async with session.post(gateway + "/v1/completions",
                                    json={"prompt": f"admission {i}", "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
                ids.append(str((await r.json())["id"]))
        return ids


def logged(cluster: LocalCluster) -> dict[str, str]:
    """Request id -> the first admission line's worker and decider, over every node's log."""
    lines = read_admissions((n.name, n.log_path) for n in cluster.nodes)
    return {rid: f"{line.worker} {line.holder} {line.decided_by}"
            for rid, line in first_admissions(lines).items()}


def test_admissions_are_logged_as_the_coordinator_decided_and_stop_on_reload(
    local_cluster: MakeCluster,
) -> None:
    cluster = local_cluster(size=2, lease_ttl_s=3, shadows=0, log_admissions=True)
    view = wait_until(all_serving(cluster), 60, "2 serving workers and one coordinator")
    assert view.coordinator is not None
    epoch = view.coordinator.epoch

    async def coordinator_sees_both() -> None:
        client = coordinator_client(view)
        try:
            await caught_up(client, 2, with_checkpoint=True)
        finally:
            await client.close()

    asyncio.run(coordinator_sees_both())
    gateway: LumendNode = cluster.nodes[0]
    ids = asyncio.run(completion_ids(gateway.gateway, 4))
    found = logged(cluster)
    assert set(ids) <= set(found), (ids, found)
    for rid in ids:
        worker, holder, decided_by = found[rid].split(" ", 2)
        assert worker in view.workers, found[rid]
        # mode lumen: a checkpoint on the other worker, decided by the coordinator
        assert holder in view.workers and holder != worker, found[rid]
        assert decided_by.startswith(f"coordinator epoch {epoch}: "), found[rid]

    # Off by a reload: the same node logs no more admissions (the negative control).
    gateway.config_path.write_text(
        gateway.config_path.read_text().replace("log_admissions = true", ""))
    gateway.signal(signal.SIGHUP)
    wait_until(lambda: "reload: applied gateway.log_admissions" in gateway.log_text(), 20,
               "the reload to apply gateway.log_admissions")
    unlogged = asyncio.run(completion_ids(gateway.gateway, 2))
    assert not set(unlogged) & set(logged(cluster)), unlogged
