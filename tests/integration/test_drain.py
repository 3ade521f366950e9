"""`lumenctl drain` against real lumend nodes, real etcd and real sim engines: without
--migrate the streams in flight finish where they are and new requests go elsewhere; with
--migrate they move to their checkpoint holders and still equal the failure-free streams
token for token; --wait exits 0 once the target is empty and 1, naming what is left, when
its timeout passes first."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster
from lumend.cluster.view import ClusterView
from lumend.engine.sim_core import decode, encode, reference_completion

from ..streamread import read_stream
from .conftest import wait_until
from .test_coordinator import all_serving, caught_up, coordinator_client, metric
from .test_gateway_e2e import engine_metric

MakeCluster = Callable[..., LocalCluster]

VICTIM = "node-1-w0"  # the worker on the node whose gateway the clients use
OTHER = "node-2-w0"


def lumenctl(cluster: LocalCluster, *args: str) -> subprocess.Popen[str]:
    """lumenctl as an operator runs it (no TTY), in the background."""
    return subprocess.Popen(
        [sys.executable, "-m", "lumenctl", "--config", "/nonexistent/lumend.toml",
         "--endpoints", ",".join(cluster.endpoints), "--cluster", cluster.cluster, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)


def finished(proc: subprocess.Popen[str], timeout_s: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"lumenctl did not end within {timeout_s} s: {out} {err}")
    return proc.returncode, out, err


def expected(prompt: str, chat: bool, max_tokens: int) -> str:
    text = f"user: {prompt}\nassistant: " if chat else prompt
    return decode(reference_completion(0, encode(text), max_tokens))


async def stream(session: aiohttp.ClientSession, base: str, prompt: str, chat: bool,
                 max_tokens: int, received: list[int]) -> tuple[set[str], str, list[str]]:
    """(ids seen, text received, errors) of one streamed completion."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    async with session.post(base + ("/v1/chat/completions" if chat else "/v1/completions"),
                            json=body) as r:
        assert r.status == 200
        return await read_stream(r, chat, received)


class Streams:
    """Concurrent streams through a gateway (odd ones chat), started and mid-way."""

    def __init__(self, session: aiohttp.ClientSession, base: str, pattern: str, count: int,
                 max_tokens: int) -> None:
        self.prompts = [pattern.format(i) for i in range(count)]
        self.max_tokens = max_tokens
        self.received = [[0] for _ in self.prompts]
        self.tasks = [asyncio.create_task(stream(session, base, p, i % 2 == 1, max_tokens,
                                                 self.received[i]))
                      for i, p in enumerate(self.prompts)]

    async def going(self, pieces: int = 10) -> None:
        deadline = time.monotonic() + 60
        while min(r[0] for r in self.received) < pieces:
            assert time.monotonic() < deadline, "the streams never got going"
            await asyncio.sleep(0.01)

    async def check_against_failure_free(self) -> None:
        results = await asyncio.gather(*self.tasks)
        for i, (prompt, (ids, text, errors)) in enumerate(zip(self.prompts, results,
                                                               strict=True)):
            assert errors == []
            assert len(ids) == 1, "one id for the whole stream"
            assert text == expected(prompt, i % 2 == 1, self.max_tokens), (
                f"stream {i} differs from the failure-free stream")


def engines_total(view: ClusterView, worker: str, name: str) -> float:
    return sum(engine_metric(e.url, name) for e in view.workers[worker].engines)


def view_of(cluster: LocalCluster) -> ClusterView:
    return read_view(cluster.endpoints, cluster.cluster)


def busy(cluster: LocalCluster, worker: str) -> ClusterView | None:
    """A view whose heartbeat shows requests running on `worker`."""
    view = view_of(cluster)
    return view if view.workers[worker].load.running else None


def drain_seen(cluster: LocalCluster) -> ClusterView | None:
    """The victim's node publishes it as drained or draining, and the coordinator has
    decided with the intent in its view (its status counts the intents)."""
    view = view_of(cluster)
    worker = view.workers.get(VICTIM)
    status = view.coordinator_status
    if (worker is None or worker.state not in ("draining", "drained") or status is None
            or "1 intents" not in status.decision):
        return None
    return view


@pytest.fixture
def cluster(local_cluster: MakeCluster) -> Iterator[LocalCluster]:
    # No shadows (nothing here needs one) and slow engines, so streams are mid-way for
    # seconds.
    c = local_cluster(size=2, lease_ttl_s=3, shadows=0, engine_args=("--time-scale", "3.0"))
    wait_until(all_serving(c), 60, "both workers serving")
    yield c


async def ready(cluster: LocalCluster, session: aiohttp.ClientSession, base: str) -> None:
    """The gateway and the coordinator (each reads the cluster once per HA cycle) both see
    the two workers serving."""
    deadline = time.monotonic() + 30
    while True:
        async with session.get(base + "/health") as r:
            if r.status == 200 and (await r.json())["serving_workers"] == 2:
                break
        assert time.monotonic() < deadline, "the gateway never saw both workers"
        await asyncio.sleep(0.1)
    client = coordinator_client(await asyncio.to_thread(view_of, cluster))
    try:
        await caught_up(client, 2)
    finally:
        await client.close()


async def complete(session: aiohttp.ClientSession, base: str, prompt: str) -> None:
    async with session.post(base + "/v1/completions",
                            json={"prompt": prompt, "max_tokens": 4}) as r:
        assert r.status == 200
        assert (await r.json())["choices"][0]["text"] == expected(prompt, False, 4)


def test_drain_lets_streams_finish_and_sends_new_requests_elsewhere(
        cluster: LocalCluster) -> None:
    base = cluster.node("node-1").gateway
    node = cluster.node("node-1")

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            await ready(cluster, session, base)
            streams = Streams(session, base, "drain without migrate, stream {}", 8, 400)
            await streams.going()
            view = await asyncio.to_thread(view_of, cluster)
            before = engines_total(view, VICTIM, "lumen_sim_requests_total")
            assert before >= 1, "no stream runs on the victim: the test is void"
            drain = lumenctl(cluster, "drain", VICTIM, "--yes", "--wait", "--wait-timeout", "90")
            await asyncio.to_thread(wait_until, lambda: drain_seen(cluster), 20,
                                    "the drain intent seen by the node and the coordinator")
            # New requests, while the victim's streams are still running: none goes there.
            for i in range(6):
                await complete(session, base, f"a new request {i}")
            assert engines_total(view, VICTIM, "lumen_sim_requests_total") == before
            running = await asyncio.to_thread(view_of, cluster)
            assert running.workers[VICTIM].state == "draining", (
                "the victim's streams ended before the new requests: the test is void")
            await streams.check_against_failure_free()
            code, out, err = await asyncio.to_thread(finished, drain)
            assert code == 0, err
            assert f"drained worker {VICTIM}" in out
            assert "draining" in out  # the progress lines came first
            # The streams finished on the victim: none was moved or resumed.
            assert metric(node, "lumen_gateway_migrations_total") == 0
            assert metric(node, "lumen_gateway_resumes_total") == 0
            after = await asyncio.to_thread(view_of, cluster)
            assert after.workers[VICTIM].state == "drained"
            assert any(e.kind == "drained" and VICTIM in e.message for e in after.events)
            # Negative control: once undrained, requests reach the victim again.
            undrain = lumenctl(cluster, "undrain", VICTIM)
            assert (await asyncio.to_thread(finished, undrain))[0] == 0
            await asyncio.to_thread(wait_until, lambda: all_serving(cluster)(), 20,
                                    "the victim serving again")
            await ready(cluster, session, base)
            for i in range(6):
                await complete(session, base, f"after undrain {i}")
            assert engines_total(view, VICTIM, "lumen_sim_requests_total") > before

    asyncio.run(scenario())


def test_drain_migrate_moves_streams_to_their_holders_token_for_token(
        cluster: LocalCluster) -> None:
    base = cluster.node("node-1").gateway
    node = cluster.node("node-1")

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            await ready(cluster, session, base)
            # Long enough that no stream could finish on its own before --wait gives up.
            streams = Streams(session, base, "drain with migrate, stream {}", 8, 1500)
            await streams.going(pieces=20)
            view = await asyncio.to_thread(wait_until, lambda: busy(cluster, VICTIM), 10,
                                           "streams on the victim (nothing to migrate)")
            restored_before = engines_total(view, OTHER, "lumen_sim_restored_tokens_total")
            drain = lumenctl(cluster, "drain", VICTIM, "--migrate", "--yes", "--wait",
                             "--wait-timeout", "60")
            code, out, err = await asyncio.to_thread(finished, drain, 90)
            # Empty long before the streams end: they moved (each still has >1000 tokens).
            assert code == 0, err
            assert f"drained worker {VICTIM}" in out
            assert min(r[0] for r in streams.received) < streams.max_tokens
            await streams.check_against_failure_free()
            moved = metric(node, "lumen_gateway_migrations_total")
            assert moved >= 1
            # Exactly as in a recovery: Recover sent them to their holder (the other node's
            # worker), which resumed them from the checkpointed pages.
            restored = engines_total(view, OTHER, "lumen_sim_restored_tokens_total")
            assert restored > restored_before, "no moved stream resumed from its checkpoint"
            assert metric(node, "lumen_gateway_coordinated_total", '{call="recover"}') >= moved
            log = node.log_text()
            assert "resumed from its checkpoint" in log
            after = await asyncio.to_thread(view_of, cluster)
            assert after.workers[VICTIM].state == "drained"
            assert after.workers[VICTIM].load.running == 0

    asyncio.run(scenario())


def test_drain_wait_times_out_naming_what_is_left(cluster: LocalCluster) -> None:
    base = cluster.node("node-1").gateway

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            await ready(cluster, session, base)
            # An idle worker drains at once; -o json reports the same rows.
            idle = lumenctl(cluster, "-o", "json", "drain", OTHER, "--yes", "--wait",
                            "--wait-timeout", "30")
            code, out, err = await asyncio.to_thread(finished, idle)
            assert code == 0, err
            doc = json.loads(out[out.index("{"):])
            assert doc["outcome"] == "drained" and doc["target"] == OTHER
            assert [w["name"] for w in doc["workers"]] == [OTHER]
            assert doc["workers"][0]["in_flight"] == 0
            # Undrain it again; then a long stream on the victim outlasts --wait-timeout.
            assert (await asyncio.to_thread(finished, lumenctl(cluster, "undrain", OTHER)))[0] == 0
            await asyncio.to_thread(wait_until, lambda: all_serving(cluster)(), 20,
                                    "both serving again")
            await ready(cluster, session, base)
            # Two streams on an idle cluster: the coordinator puts one on each worker.
            streams = Streams(session, base, "a long one {}", 2, 3000)
            await streams.going()
            view = await asyncio.to_thread(wait_until, lambda: busy(cluster, VICTIM), 10,
                                           "a stream on the victim (nothing to name)")
            assert view.workers[VICTIM].load.running == 1
            drain = lumenctl(cluster, "drain", "node-1", "--yes", "--wait", "--wait-timeout", "3")
            code, out, err = await asyncio.to_thread(finished, drain)
            assert code == 1
            assert "the drain of node node-1 did not finish within 3 s" in err
            assert f"{VICTIM} is draining with 1 requests in flight" in err
            assert "lumenctl undrain node-1" in err
            for task in streams.tasks:
                task.cancel()
            await asyncio.gather(*streams.tasks, return_exceptions=True)

    asyncio.run(scenario())
