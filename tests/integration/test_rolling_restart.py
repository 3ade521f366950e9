"""A restart of lumend under streaming load, as the Ansible role does it on a config,
certificate or wheel change (ansible/roles/lumend/tasks/drain.yml): `lumenctl drain NODE
--migrate --wait`, restart, `lumenctl undrain NODE`. Real etcd, real lumend processes, real
sim engines; the clients stream through the other node's gateway.

lumend does not re-adopt its engines across a restart (they stop with it and reload), so
the drain is what keeps streams whole: every stream completes token for token as the
failure-free stream, none of their upstreams broke (the migration is make-before-break), and
the restarted node reloaded its engine anyway. Negative control: the same restart without
the drain (and `drain_s = 0`, a stream longer than the graceful stop waits) breaks the
streams on the node's engine; the client's gateway sees it (upstreams broken, recovered)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import aiohttp

from lumenctl.localcluster import LocalCluster, LumendNode

from .conftest import wait_until
from .test_coordinator import all_serving, metric
from .test_drain import Streams, busy, finished, lumenctl, ready, view_of
from .test_graceful_stop import set_drain_s

MakeCluster = Callable[..., LocalCluster]
VICTIM = "node-1"
VICTIM_WORKER = "node-1-w0"
CLIENT = "node-2"  # the gateway the clients stream through
STARTED = re.compile(r"engine \S+ started \(pid \d+")
BROKEN = "lumen_gateway_recovery_seconds_count"  # upstreams that broke and went on
MODEL = '{model_name="sim-small"}'


def broken(node: LumendNode) -> float:
    """Upstreams that broke mid-stream at the node's gateway and went on elsewhere."""
    return metric(node, BROKEN, MODEL)


def engine_starts(node: LumendNode) -> int:
    """Engines started by the node's lumend processes so far (its log spans restarts)."""
    return len(STARTED.findall(node.log_text()))


def drain(cluster: LocalCluster, node: str, timeout_s: float = 60) -> str:
    """What the role runs before a restart: exit 0 once nothing is in flight there."""
    code, out, err = finished(lumenctl(cluster, "drain", node, "--migrate", "--yes", "--wait",
                                       "--wait-timeout", f"{timeout_s:g}",
                                       "--reason", "rolling restart"), timeout_s + 30)
    assert code == 0, err
    return out


def undrain(cluster: LocalCluster, node: str) -> None:
    code, _, err = finished(lumenctl(cluster, "undrain", node))
    assert code == 0, err


def restart(node: LumendNode, streams: Streams | None = None, grace_s: float = 60) -> None:
    """SIGTERM (the graceful stop), wait for the exit, start it again on the same config;
    `streams` must all still be going while the node is down."""
    code = node.stop(grace_s)
    assert code == 0, f"lumend exited with {code}: {node.log_text()[-3000:]}"
    if streams is not None:
        assert min(r[0] for r in streams.received) < streams.max_tokens, (
            "a stream ended before the restart: the test is void")
    node.start()


def test_a_drained_then_restarted_node_loses_no_stream(local_cluster: MakeCluster) -> None:
    cluster = local_cluster(size=2, lease_ttl_s=3, shadows=0,
                            engine_args=("--time-scale", "3.0"))
    wait_until(all_serving(cluster), 60, "both workers serving")
    victim, client = cluster.node(VICTIM), cluster.node(CLIENT)
    base = client.gateway
    # The graceful stop waits for nothing (a stream longer than drain_s): the negative
    # control then breaks streams; the drained restart has nothing in flight to wait for.
    set_drain_s(victim, 0)

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            await ready(cluster, session, base)
            # Long enough that every stream is still going when the node is back.
            streams = Streams(session, base, "rolling restart, drained, stream {}", 8, 1500)
            await streams.going(pieces=20)
            await asyncio.to_thread(wait_until, lambda: busy(cluster, VICTIM_WORKER), 10,
                                    "streams on the victim (the restart would cut nothing)")
            before, starts = broken(client), engine_starts(victim)
            out = await asyncio.to_thread(drain, cluster, VICTIM)
            assert f"drained node {VICTIM}" in out or f"drained worker {VICTIM_WORKER}" in out, out
            view = await asyncio.to_thread(view_of, cluster)
            assert view.workers[VICTIM_WORKER].load.running == 0
            await asyncio.to_thread(restart, victim, streams)
            await asyncio.to_thread(undrain, cluster, VICTIM)
            await asyncio.to_thread(wait_until, all_serving(cluster), 60,
                                    "the restarted node serving again")
            await streams.check_against_failure_free()
            assert metric(client, "lumen_gateway_migrations_total") >= 1
            assert broken(client) == before, "an upstream broke under the drain"
            # The drain keeps the streams, not the engines: the restart reloaded them.
            assert engine_starts(victim) == starts + 1

            # Negative control: the same restart without the drain.
            await ready(cluster, session, base)
            streams = Streams(session, base, "rolling restart, no drain, stream {}", 8, 1500)
            await streams.going(pieces=20)
            await asyncio.to_thread(wait_until, lambda: busy(cluster, VICTIM_WORKER), 10,
                                    "streams on the victim (the control would be void)")
            before = broken(client)
            await asyncio.to_thread(restart, victim, streams)
            await asyncio.to_thread(wait_until, all_serving(cluster), 60,
                                    "the restarted node serving again")
            await asyncio.gather(*streams.tasks, return_exceptions=True)
            assert broken(client) > before, (
                "a restart without drain broke no stream: the check above is void")
            assert "stream from node-1-w0 broke" in client.log_text()

    asyncio.run(scenario())
