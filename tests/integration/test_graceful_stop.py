"""A graceful stop and per-node readiness, with real lumend, etcd and sim engine processes.

One node, one worker, no shadow: a stream cut by the stop has nowhere to resume, so a stream
that completes shows the engine outlived it. `/ready` flips to 503 on an operator's drain of
the node and back on undrain; on SIGTERM it answers 503 at once, new requests get 503, the
streams in flight finish, lumend exits 0. Negative control: the same stop with
`drain_s = 0` cuts the streams. lumenctl's conventions on a running cluster are checked on
this cluster too (test_lumenctl_conventions.lumenctl_conventions), to start it once."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import aiohttp

from lumenctl.localcluster import LocalCluster, LumendNode

from .conftest import wait_until
from .test_coordinator import all_serving
from .test_drain import Streams, expected
from .test_lumenctl_conventions import lumenctl_conventions

MakeCluster = Callable[..., LocalCluster]
NODE = "node-1"


def ready(node: LumendNode) -> tuple[int, dict[str, Any]]:
    """(status, body) of the node's GET /ready; (0, {}) while nothing answers."""
    try:
        with urllib.request.urlopen(node.gateway + "/ready", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


def ready_is(node: LumendNode, status: int) -> Callable[[], dict[str, Any] | None]:
    def probe() -> dict[str, Any] | None:
        code, body = ready(node)
        return body if code == status else None
    return probe


def set_drain_s(node: LumendNode, seconds: float) -> None:
    text = node.config_path.read_text()
    node.config_path.write_text(text.replace("[gateway]\n", f"[gateway]\ndrain_s = {seconds}\n",
                                             1))


Result = tuple[set[str], str, list[str]]


async def stop_under_streams(cluster: LocalCluster, node: LumendNode
                             ) -> tuple[list[Result | BaseException], list[str], int]:
    """Streams through the node's gateway, SIGTERM once they are mid-way: (each stream's
    ids, text and errors, or the exception that cut it; what a new request and /ready said
    while stopping; exit code)."""
    async with aiohttp.ClientSession() as session:
        streams = Streams(session, node.gateway, "graceful stop, stream {}", 2, 300)
        await streams.going()
        node.signal(signal.SIGTERM)
        seen = []
        body = await asyncio.to_thread(wait_until, ready_is(node, 503), 10, "/ready 503")
        seen.append(f"ready {body['phase']}")
        try:
            async with session.post(node.gateway + "/v1/completions",
                                    json={"prompt": "a new request", "max_tokens": 4}) as r:
                seen.append(f"new {r.status} {(await r.json())['error']['code']}"
                            if r.status == 503 else f"new {r.status}")
        except aiohttp.ClientError as exc:
            # A node with nothing to drain (drain_s = 0) may close its listener before
            # this request is written: refused too, though not with a 503.
            seen.append(f"new not sent: {type(exc).__name__}")
        results = await asyncio.gather(*streams.tasks, return_exceptions=True)
    assert node.proc is not None
    code = await asyncio.to_thread(node.proc.wait, 120)
    return list(results), seen, code


def test_readiness_flips_on_drain_and_a_stop_lets_streams_finish(
        local_cluster: MakeCluster) -> None:
    cluster = local_cluster(size=1, lease_ttl_s=3, shadows=0,
                            engine_args=("--time-scale", "3.0"))
    wait_until(all_serving(cluster), 60, "the worker serving")
    node = cluster.node(NODE)
    body = wait_until(ready_is(node, 200), 30, "/ready 200")
    assert body == {"node": NODE, "ready": True, "phase": "serving"}

    # An operator's drain of the node takes it out of the load balancer; undrain puts it
    # back. The drain is part of lumenctl's conventions checked on this cluster.
    def drained() -> None:
        body = wait_until(ready_is(node, 503), 30, "/ready 503 after the drain")
        assert body["phase"] == "serving" and "drained" in body["reason"], body

    lumenctl_conventions(cluster, NODE, drained)
    wait_until(ready_is(node, 200), 30, "/ready 200 after undrain")
    wait_until(all_serving(cluster), 30, "the worker serving again")

    # SIGTERM with streams in flight: not ready at once, new requests refused, the streams
    # complete (one id each, the failure-free text), a clean exit.
    results, seen, code = asyncio.run(stop_under_streams(cluster, node))
    assert seen == ["ready draining", "new 503 node_stopping"], seen
    for i, result in enumerate(results):
        assert not isinstance(result, BaseException), result
        ids, text, errors = result
        assert errors == [], errors
        assert len(ids) == 1
        assert text == expected(f"graceful stop, stream {i}", i % 2 == 1, 300)
    assert code == 0
    log = node.log_text()
    assert "new requests refused" in log
    assert "no streams in flight after" in log

    # Negative control: drain_s = 0 stops the engine at once; the streams are cut (nowhere
    # to resume on a one-worker cluster).
    set_drain_s(node, 0)
    node.start()
    wait_until(all_serving(cluster), 60, "the worker serving after the restart")
    wait_until(ready_is(node, 200), 30, "/ready 200 after the restart")
    results, seen, code = asyncio.run(stop_under_streams(cluster, node))
    assert seen[0] == "ready draining"
    cut = [i for i, result in enumerate(results)
           if isinstance(result, BaseException) or result[2]
           or result[1] != expected(f"graceful stop, stream {i}", i % 2 == 1, 300)]
    assert cut, "with drain_s = 0 the streams should have been cut: the check is void"
