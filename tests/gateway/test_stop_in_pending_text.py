"""A stop string completed in the chunk whose text the gateway renders itself: a stream cut
where its ids end inside a character resumes after all of them, and the gateway renders the
text (`PendingText`) until the character is whole. When that chunk (several tokens:
speculative decoding) also completes a stop string, the request keeps the ids through the
token at which an engine's decoder emits the stop's text, as the failure-free run does;
the gateway had kept all of the chunk's ids.

The cut is made by a proxy between a gateway and the sim engine, after a chosen number of
ids (a chunk boundary of the engine's stream where the ids end inside a character), so the
break is where the test needs it rather than where a kill happens to land."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from lumenctl.localcluster import free_ports
from lumend.cluster.view import ClusterView
from lumend.failover.supervisor import WorkerSupervisor
from lumend.gateway.server import Gateway

from ..cutproxy import CuttingProxy
from .test_resume_semantics import BPE, call, cluster

BODY: dict[str, Any] = {"prompt": "東京は日本の首都です 😀", "max_tokens": 160, "stream": True,
                        "return_token_ids": True}


async def chunk_ids(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                    ) -> tuple[list[int] | None, list[list[int]]]:
    """The prompt's ids and each chunk's generated ids of a completion streamed by `url`."""
    prompt: list[int] | None = None
    chunks: list[list[int]] = []
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            if not raw.startswith(b"data: {"):
                continue
            doc = msgspec.json.decode(raw[6:])
            choice = doc["choices"][0]
            prompt = choice.get("prompt_token_ids") or doc.get("prompt_token_ids") or prompt
            if choice.get("token_ids"):
                chunks.append(list(choice["token_ids"]))
    return prompt, chunks


async def detok(session: aiohttp.ClientSession, url: str, ids: list[int]) -> str:
    async with session.post(url + "/detokenize", json={"tokens": ids}) as r:
        return str((await r.json())["prompt"])


async def find_case(session: aiohttp.ClientSession, engine: str
                    ) -> tuple[int, str, int] | None:
    """(cut, stop, kept): a chunk boundary `cut` of the stream where its ids end inside a
    character, and a two-character stop whose text an engine emits at a token before the end
    of the chunk that, resumed after `cut`, completes that character; `kept` ids are what
    the failure-free run keeps with that stop. None when this stream has no such place."""
    prompt, chunks = await chunk_ids(session, engine, BODY)
    assert prompt is not None and len(chunks) > 1
    ids = [t for c in chunks for t in c]
    head = await detok(session, engine, prompt)
    generated = (await detok(session, engine, prompt + ids))[len(head):]
    boundaries = [sum(len(c) for c in chunks[:j]) for j in range(2, len(chunks))]
    for cut in boundaries:
        if not (await detok(session, engine, prompt + ids[:cut])).endswith("\ufffd"):
            continue
        _, resumed = await chunk_ids(session, engine, {**BODY, "prompt": prompt + ids[:cut],
                                                       "max_tokens": len(ids) - cut})
        start = cut
        for chunk in resumed:  # the chunk in which the cut character becomes whole
            whole = [k for k in range(1, len(chunk) + 1) if not (await detok(
                session, engine, prompt + ids[:start + k])).endswith("\ufffd")]
            if whole:
                break
            start += len(chunk)
        else:
            continue
        for k in whole:
            if k == len(chunk):
                break
            emitted = (await detok(session, engine, prompt + ids[:start + k]))[len(head):]
            stop = emitted[-2:]
            if len(stop) == 2 and "\ufffd" not in stop and \
                    generated.find(stop) == len(emitted) - 2:
                return cut, stop, start + k
    return None


async def _test_a_stop_in_the_gateway_rendered_chunk_keeps_the_engines_ids(
        tmp_path: Path) -> None:
    async with cluster(tmp_path, [*BPE, "--time-scale", "0.1"], workers=1) as (_, base, sups), \
            aiohttp.ClientSession() as session:
        engine = sups[0].record().engines[0].url
        case = await find_case(session, engine)
        assert case is not None, "no chunk boundary inside a character with a stop after it"
        cut, stop, kept = case
        body = {**BODY, "stop": [stop]}
        free = await call(session, base, False, body)
        direct = await call(session, engine, False, body)
        proxy = CuttingProxy(engine, lambda _, tokens: tokens >= cut)
        await proxy.start()
        gateway = Gateway(proxied(sups, engine, proxy.url))
        listen = f"127.0.0.1:{free_ports(1)[0]}"
        await gateway.start(listen)
        try:
            resumed = await call(session, f"http://{listen}", False, body)
        finally:
            await gateway.stop()
            await proxy.stop()
    assert len(proxy.cuts) == 1 and gateway.counters.resumes == 1, "no cut: the test is void"
    assert gateway.counters.inside_character == 1, "the cut was not inside a character"
    assert free["finish"] == direct["finish"] == "stop"
    assert len(free["token_ids"]) == len(direct["token_ids"]) == kept, (stop, kept)
    assert resumed["status"] == 200 and not resumed["errors"], resumed["errors"]
    assert len(resumed["ids"]) == 1
    assert resumed["text"] == free["text"]
    assert resumed["finish"] == free["finish"]
    assert resumed["token_ids"] == free["token_ids"], (
        f"stop {stop!r} after a cut at {cut}: {len(resumed['token_ids'])} ids resumed, "
        f"{len(free['token_ids'])} failure-free")


def proxied(sups: list[WorkerSupervisor], engine: str, proxy: str
            ) -> Any:
    def view() -> ClusterView:
        workers = {}
        for s in sups:
            record = s.record()
            engines = [msgspec.structs.replace(e, url=proxy if e.url == engine else e.url)
                       for e in record.engines]
            workers[s.worker.name] = msgspec.structs.replace(record, engines=engines)
        return ClusterView(cluster="t", revision=0, workers=workers)
    return view


def test_a_stop_in_the_gateway_rendered_chunk_keeps_the_engines_ids(tmp_path: Path) -> None:
    asyncio.run(_test_a_stop_in_the_gateway_rendered_chunk_keeps_the_engines_ids(tmp_path))
