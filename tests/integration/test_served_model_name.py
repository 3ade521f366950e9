"""Workers whose engines serve under vLLM's --served-model-name (issue 17), through real
lumend nodes and sim engines that, like vLLM, answer 404 to any other model name: the
gateway lists and routes the served name, refuses the model path, and sends the served
name on to the engines, resumes included."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster

from ..gateway.test_gateway import MAX_TOKENS, expected
from .conftest import wait_until
from .test_gateway_e2e import streams_survive_a_kill

MakeCluster = Callable[..., LocalCluster]
SERVED = "short"
ALIAS = "tiny"  # a second --served-model-name: routed as the first


async def completion(session: aiohttp.ClientSession, base: str, model: str,
                     prompt: str, answers_as: str | None = None) -> tuple[int, Any]:
    """(status, the streamed text or the error body) of a streamed completion for `model`,
    whose chunks name `answers_as` (default: `model`)."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
    async with session.post(base + "/v1/completions", json=body) as r:
        if r.status != 200:
            return r.status, await r.json()
        chunks = [json.loads(line[5:]) async for raw in r.content
                  if (line := raw.decode().strip()).startswith("data:")
                  and line != "data: [DONE]"]
    assert all("error" not in c for c in chunks), chunks
    assert {c["model"] for c in chunks} == {answers_as or model}
    return r.status, "".join(c["choices"][0]["text"] for c in chunks)


def test_a_served_model_name_is_listed_routed_and_resumed_by(local_cluster: MakeCluster) -> None:
    cluster = local_cluster(size=2, lease_ttl_s=3, shadows=0, engine_args=(
        "--time-scale", "2.0", "--served-model-name", SERVED, ALIAS))

    def serving() -> bool:
        for node in cluster.nodes:
            # Fail at once, with its reason, if lumend refused the config.
            assert node.running, f"{node.name} exited:\n{node.log_text()[-2000:]}"
        view = read_view(cluster.endpoints, cluster.cluster)
        return len(view.workers) == 2 and all(
            w.state == "serving" and w.checkpoints.budget_bytes > 0
            for w in view.workers.values())

    wait_until(serving, 60, "both workers serving")
    view = read_view(cluster.endpoints, cluster.cluster)
    assert {w.model for w in view.workers.values()} == {SERVED}
    assert all(w.aliases == [ALIAS] for w in view.workers.values())
    base = cluster.node("node-1").gateway

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.get(base + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == [SERVED, ALIAS]
            prompt = "a request for the served name"
            assert await completion(session, base, SERVED, prompt) == (200, expected(prompt))
            # The other name: routed as the first, answered under it (as vLLM answers).
            assert await completion(session, base, ALIAS, prompt, answers_as=SERVED) == (
                200, expected(prompt))
            # The model the engines load is not a name the cluster serves.
            status, body = await completion(session, base, "sim-small", prompt)
            assert status == 404 and body["error"]["param"] == "model", body
            assert "'sim-small' is not served by this cluster" in body["error"]["message"]
        # Streams without a model: the gateway sends the served name to the engines, and
        # again when it resumes them on the other worker after a kill.
        await streams_survive_a_kill(cluster, base, "stream {} for a served name")

    asyncio.run(scenario())
    assert "resuming request" in cluster.node("node-1").log_text(), "no stream was resumed"
