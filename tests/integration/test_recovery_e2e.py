"""Issue 5's end to end test: 4 lumend nodes on loopback (sim engines, real etcd), 32
concurrent streams through one gateway, SIGKILL of one worker's engine (no shadow) mid-stream.
Every stream completes under one id and equals the failure-free stream token for token.
Where the interrupted requests went comes from the coordinator's recovery plan in etcd
(`recovery/<worker>`, also in `lumenctl status -o json`): under `lumen` they resume on
several holders, under `fixed_checkpoint` (set live in the same cluster) all on the victim's
static neighbour. The two policies are each other's control: the same spread check tells
them apart."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable

import aiohttp

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster
from lumenctl.recovery import lumenctl
from lumend.cluster.models import RecoveryPlan
from lumend.rpc.client import CoordinatorClient

from ..gateway.test_gateway import chat_prompt, expected, stream
from .conftest import wait_until
from .test_coordinator import all_serving, caught_up, metric

MakeCluster = Callable[..., LocalCluster]

VICTIM = "node-4-w0"
STREAMS = 32
RECOVER = ("lumen_gateway_coordinated_total", '{call="recover"}')


async def coordinator_in_mode(cluster: LocalCluster, mode: str, workers: int) -> None:
    """Wait until the coordinator admits under `mode` and its view has every worker serving
    (`caught_up` with `policy`)."""
    view = await asyncio.to_thread(read_view, cluster.endpoints, cluster.cluster)
    assert view.coordinator is not None
    client = CoordinatorClient(view.coordinator.record.rpc)
    try:
        await caught_up(client, workers, 30.0, policy=mode)
    finally:
        await client.close()


def engine_running(url: str) -> int:
    with urllib.request.urlopen(url + "/lumen/engine", timeout=5) as r:
        return int(json.load(r)["running"])


async def one_fault(cluster: LocalCluster, mode: str) -> None:
    """32 streams through node-1's gateway; the victim's engine SIGKILLed once all are going;
    every stream checked against the failure-free one."""
    prompts = [f"stream {i} of {STREAMS} under {mode}" for i in range(STREAMS)]
    received = [[0] for _ in prompts]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        base = cluster.node("node-1").gateway
        tasks = [asyncio.create_task(stream(session, base, i % 2 == 1, p, received[i]))
                 for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 60
        while min(r[0] for r in received) < 16:  # all mid-stream, with full KV blocks
            assert time.monotonic() < deadline, "the streams never got going"
            assert not any(t.done() for t in tasks), "a stream ended before the fault"
            await asyncio.sleep(0.02)
        view = await asyncio.to_thread(read_view, cluster.endpoints, cluster.cluster)
        engine = next(e for e in view.workers[VICTIM].engines if e.role == "active")
        assert engine.pid is not None
        running = await asyncio.to_thread(engine_running, engine.url)
        assert running >= 3, f"only {running} streams on {VICTIM}: nothing much to recover"
        os.kill(engine.pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    for i, (prompt, (ids, text, errors)) in enumerate(zip(prompts, results, strict=True)):
        assert errors == [], f"stream {i} got an error chunk"
        assert len(ids) == 1, f"stream {i} changed its id: {sorted(ids)}"
        reference = expected(chat_prompt(prompt) if i % 2 == 1 else prompt)
        assert text == reference, f"stream {i} differs from the failure-free stream"


def plan_after(cluster: LocalCluster, since: float, decisions: int) -> RecoveryPlan:
    """The victim's recovery plan of the failure after `since`, once it holds every decision
    the gateway was given."""

    def probe() -> RecoveryPlan | None:
        plan = read_view(cluster.endpoints, cluster.cluster).recoveries.get(VICTIM)
        if plan is None or plan.failed_at < since or plan.total < decisions:
            return None
        return plan

    return wait_until(probe, 30, f"the recovery plan of {VICTIM} with {decisions} decisions")


def test_interrupted_requests_spread_under_lumen_and_go_to_the_neighbour_under_fixed(
    local_cluster: MakeCluster,
) -> None:
    cluster = local_cluster(size=4, lease_ttl_s=3, shadows=0,
                            engine_args=("--time-scale", "3.0"))
    wait_until(all_serving(cluster), 90, "4 serving workers and one coordinator")
    gateway = cluster.node("node-1")
    plans: dict[str, RecoveryPlan] = {}
    for mode in ("lumen", "fixed_checkpoint"):
        lumenctl(cluster, "config", "set", "mode", mode, "--yes")
        wait_until(all_serving(cluster), 60, f"every worker serving before the {mode} fault")
        asyncio.run(coordinator_in_mode(cluster, mode, 4))
        before, started = metric(gateway, *RECOVER), time.time()
        asyncio.run(one_fault(cluster, mode))
        asked = int(metric(gateway, *RECOVER) - before)
        assert asked >= 3, f"only {asked} streams were recovered under {mode}: test void"
        plan = plan_after(cluster, started, asked)
        assert plan.total == len(plan.decisions) == asked, "one decision per recovery"
        assert plan.cause == "failed" and VICTIM not in plan.targets
        plans[mode] = plan
        if mode == "lumen":
            # It serves again with a new engine: the coordinator closes the plan, so the
            # next failure starts one of its own.
            wait_until(lambda: (p := read_view(cluster.endpoints, cluster.cluster)
                                .recoveries.get(VICTIM)) is not None
                       and p.served_again_at is not None, 60, f"{VICTIM} serving again")

    resumed = {m: {d.target for d in p.decisions if d.action == "resume" and d.target == d.holder}
               for m, p in plans.items()}
    lumen, fixed = plans["lumen"], plans["fixed_checkpoint"]
    assert len(resumed["lumen"]) >= 2, (
        f"under lumen the interrupted requests resumed on {lumen.targets}: not spread")
    assert len(fixed.targets) == 1 and len(resumed["fixed_checkpoint"]) == 1, (
        f"under fixed_checkpoint they went to {fixed.targets}, not the one neighbour")
    assert fixed.resumed == fixed.total
    assert fixed.failed_at > lumen.failed_at
    # lumenctl shows the same record.
    doc = json.loads(lumenctl(cluster, "-o", "json", "status"))
    (shown,) = [p for p in doc["recoveries"] if p["worker"] == VICTIM]
    assert shown["targets"] == fixed.targets and shown["total"] == fixed.total
