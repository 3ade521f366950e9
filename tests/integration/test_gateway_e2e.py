"""Through lumend's own gateway: streams survive SIGKILL of the engine serving them (no
shadow), and equal the failure-free streams token for token."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections.abc import Callable

import aiohttp

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster

from ..gateway.test_gateway import Streams
from .conftest import wait_until
from .test_coordinator import metric

MakeCluster = Callable[..., LocalCluster]


def engine_metric(url: str, name: str) -> float:
    """0 for an engine that does not answer (the killed one, while it restarts)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


async def streams_survive_a_kill(cluster: LocalCluster, base: str, text: str) -> str:
    """Streams through `base` while the active engine of the worker running most of them is
    SIGKILLed; every stream must equal the failure-free one. Returns the victim's name."""
    async with aiohttp.ClientSession() as session:
        wait_gateway = time.monotonic() + 30
        while True:  # the gateway reads the cluster once per HA cycle
            async with session.get(base + "/health") as r:
                if r.status == 200 and (await r.json())["serving_workers"] == 2:
                    break
            assert time.monotonic() < wait_gateway, "the gateway never saw a worker"
            await asyncio.sleep(0.1)
        # The coordinator decides from its own view, read once per HA cycle (1 s): until
        # it has seen the other worker serving, it has no holder to place checkpoints on.
        await asyncio.sleep(2.5)
        streams = await Streams.start(session, base, text)
        # Kill the engine the streams run on: wait until a heartbeat shows them (load
        # is published once per HA cycle; on a busy machine the first read is stale).
        deadline = time.monotonic() + 15
        while True:
            view = await asyncio.to_thread(read_view, cluster.endpoints, cluster.cluster)
            victim = max(view.workers.values(), key=lambda w: w.load.running)
            if victim.load.running > 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        pid = next(e.pid for e in victim.engines if e.role == "active")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await streams.check_against_failure_free()
        return victim.name


def test_streams_through_lumend_survive_an_engine_kill(local_cluster: MakeCluster) -> None:
    cluster = local_cluster(size=2, lease_ttl_s=3, shadows=0,
                            engine_args=("--time-scale", "2.0"))

    def serving() -> bool:
        view = read_view(cluster.endpoints, cluster.cluster)
        # Serving, and holding checkpoints: a budget shows in a heartbeat.
        return len(view.workers) == 2 and all(
            w.state == "serving" and w.checkpoints.budget_bytes > 0
            for w in view.workers.values())

    wait_until(serving, 60, "both workers serving")
    base = cluster.node("node-1").gateway

    async def scenario() -> None:
        await streams_survive_a_kill(cluster, base, "stream {} of the end-to-end test")
        log = cluster.node("node-1").log_text()
        assert "resuming request" in log, "no stream was interrupted: the test is void"
        # Streams were checkpointed to a holder on the other node, and the interrupted ones
        # resumed from their pages there instead of recomputing their whole prefix.
        view = await asyncio.to_thread(read_view, cluster.endpoints, cluster.cluster)
        restored = 0.0
        for worker in view.workers.values():
            for engine in worker.engines:
                restored += engine_metric(engine.url, "lumen_sim_restored_tokens_total")
        assert restored > 0, "no interrupted stream was resumed from its checkpoint"

    asyncio.run(scenario())
    # Admissions and recoveries were the coordinator's decisions, none local.
    node = cluster.node("node-1")
    assert metric(node, "lumen_gateway_coordinated_total", '{call="admit"}') >= 8
    assert metric(node, "lumen_gateway_coordinated_total", '{call="recover"}') >= 1
    assert metric(node, "lumen_gateway_degraded_total", '{call="admit"}') == 0



def test_with_a_coordinator_a_worker_with_a_shadow_continues_its_streams(
        local_cluster: MakeCluster) -> None:
    """The shadow takes over within the gateway's wait: the interrupted streams continue on
    the same worker (after their token ids), not on the other one through Recover."""
    cluster = local_cluster(size=2, lease_ttl_s=3, shadows=1,
                            engine_args=("--time-scale", "2.0"))

    def serving() -> bool:
        view = read_view(cluster.endpoints, cluster.cluster)
        return len(view.workers) == 2 and all(
            w.state == "serving" and len(w.engines) == 2
            and w.checkpoints.budget_bytes > 0 for w in view.workers.values())

    wait_until(serving, 90, "both workers serving with a shadow")
    base = cluster.node("node-1").gateway

    victim = asyncio.run(streams_survive_a_kill(cluster, base,
                                                "stream {} with a shadow behind it"))
    node = cluster.node("node-1")
    log = node.log_text()
    assert f"continues on {victim}: its shadow engine took over" in log, \
        "no stream continued on its own worker's shadow"
    assert metric(node, "lumen_gateway_routed_total", '{decision="shadow"}') >= 1
    assert metric(node, "lumen_gateway_coordinated_total", '{call="admit"}') >= 8
