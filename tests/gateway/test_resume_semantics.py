"""Resume semantics through the gateway with sim engines that behave like real models: a
byte-level BPE-like tokenizer (a character spans tokens, text re-encodes to other ids) and
several tokens per chunk (speculative decoding). Also the gateway's limits and errors: an
exhausted stream pool, an engine's 400, a stream broken long after it started, a slow first
token."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

from lumend.failover.supervisor import WorkerSupervisor
from lumend.gateway.server import Gateway, GatewayTiming

from .test_gateway import cluster as sim_cluster

BPE = ["--tokenizer", "bpe", "--tokens-per-chunk", "4", "--max-model-len", "400"]


@asynccontextmanager
async def cluster(tmp_path: Path, args: list[str], shadows: int = 0, workers: int = 2,
                  timing: GatewayTiming | None = None
                  ) -> AsyncIterator[tuple[Gateway, str, list[WorkerSupervisor]]]:
    async with sim_cluster(tmp_path, shadows, tuple(args), workers, timing) as parts:
        yield parts


async def call(session: aiohttp.ClientSession, url: str, chat: bool, body: dict[str, Any],
               seen: list[int] | None = None) -> dict[str, Any]:
    """What a client gets: status, ids, text, token ids, usage, finish, errors."""
    out: dict[str, Any] = {"ids": set(), "text": "", "token_ids": [], "usage": None,
                           "finish": None, "errors": [], "prompt_ids": None, "chunks": 0,
                           "logprobs": 0, "leaked": False}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(url + path, json=body) as r:
        out["status"] = r.status
        out["headers"] = dict(r.headers)
        if r.status != 200:
            out["errors"].append(await r.json())
            return out
        if not body.get("stream"):
            doc = await r.json()
            choice = doc["choices"][0]
            out["ids"].add(doc["id"])
            out["text"] = choice["message"]["content"] if chat else choice["text"]
            out["token_ids"] = choice.get("token_ids") or []
            out["usage"], out["finish"] = doc["usage"], choice["finish_reason"]
            return out
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                out["errors"].append(chunk["error"])
                continue
            out["ids"].add(chunk["id"])
            out["usage"] = chunk.get("usage") or out["usage"]
            out["prompt_ids"] = chunk.get("prompt_token_ids") or out["prompt_ids"]
            for choice in chunk["choices"]:
                out["chunks"] += 1
                out["text"] += (choice["delta"].get("content") or "") if chat else choice["text"]
                if ("token_ids" in choice or "prompt_token_ids" in chunk
                        or "prompt_token_ids" in choice) and not body.get("return_token_ids"):
                    out["leaked"] = True
                out["token_ids"] += choice.get("token_ids") or []
                out["prompt_ids"] = choice.get("prompt_token_ids") or out["prompt_ids"]
                out["finish"] = choice.get("finish_reason") or out["finish"]
                if choice.get("logprobs"):
                    lp = choice["logprobs"]
                    out["logprobs"] += len(lp["content"] if chat else lp["tokens"])
                if seen is not None:
                    seen[0] += 1
    return out


def kill_busiest(gateway: Gateway, sups: list[WorkerSupervisor]) -> WorkerSupervisor:
    """SIGKILL the active engine of the worker with the most of the gateway's streams."""
    victim = max(sups, key=lambda s: gateway.in_flight[s.worker.name])
    active = next(s for s in victim.slots if s.state == "active")
    assert active.proc is not None
    os.kill(active.proc.pid, signal.SIGKILL)
    return victim


CASES: list[tuple[str, bool, dict[str, Any]]] = [
    ("completion", False, {"prompt": "東京は日本の首都です 😀", "max_tokens": 160, "stream": True,
                           "return_token_ids": True}),
    ("chat", True, {"messages": [{"role": "user", "content": "café résumé 🎉"}],
                    "max_tokens": 160, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}}),
    ("chat-plain", True, {"messages": [{"role": "user", "content": "Привет"}],
                          "max_completion_tokens": 150, "stream": True}),
    ("echo", False, {"prompt": "ñandú pingüino ", "max_tokens": 150, "stream": True,
                     "echo": True, "stream_options": {"include_usage": True}}),
    ("logprobs", False, {"prompt": "한국어 ", "max_tokens": 150, "stream": True, "logprobs": 2,
                         "return_token_ids": True}),
    ("chat-logprobs", True, {"messages": [{"role": "user", "content": "Grüße"}],
                             "max_tokens": 150, "stream": True, "logprobs": True,
                             "top_logprobs": 1}),
]


async def _test_bpe_streams_resume_token_identical_across_an_engine_kill(
        tmp_path: Path) -> None:
    async with cluster(tmp_path, [*BPE, "--time-scale", "2.0"]) as (gateway, base, sups), \
            aiohttp.ClientSession() as session:
        reference = {name: await call(session, base, chat, body) for name, chat, body in CASES}
        late = reference["completion"]["text"]
        stop = late[len(late) * 2 // 3:][:2]
        stop_case = ("stop", False, {**CASES[0][2], "stop": [stop]})
        reference["stop"] = await call(session, base, False, stop_case[2])
        assert reference["stop"]["finish"] == "stop" and len(reference["stop"]["text"]) < len(
            late), "the stop string did not stop the reference"
        assert any(r["chunks"] < len(r["token_ids"]) for r in reference.values()), \
            "no chunk carried several tokens"
        for name, ref in reference.items():
            assert ref["status"] == 200 and not ref["errors"], (name, ref)

        cases = [*CASES, stop_case]
        seen = [[0] for _ in cases]
        tasks = [asyncio.create_task(call(session, base, chat, body, seen[i]))
                 for i, (_, chat, body) in enumerate(cases)]
        while min(s[0] for s in seen) < 12:
            await asyncio.sleep(0.005)
        kill_busiest(gateway, sups)
        results = await asyncio.gather(*tasks)
    assert gateway.counters.resumes >= 1, "no stream was interrupted: the test is void"
    for (name, _, body), got in zip(cases, results, strict=True):
        ref = reference[name]
        assert got["status"] == 200 and not got["errors"], (name, got["errors"])
        assert len(got["ids"]) == 1, name
        assert not got["leaked"], f"{name}: token ids sent to a client that did not ask"
        assert got["text"] == ref["text"], f"{name}: text differs after the kill"
        assert got["token_ids"] == ref["token_ids"], f"{name}: ids differ after the kill"
        assert got["usage"] == ref["usage"] and got["finish"] == ref["finish"], name
        assert got["logprobs"] == ref["logprobs"], name
        if name == "echo":
            assert got["text"].count(body["prompt"]) == 1
        if got["usage"] is not None:
            assert got["usage"]["completion_tokens"] == (len(got["token_ids"]) or
                                                         got["usage"]["completion_tokens"])


async def _test_text_resume_is_not_an_id_resume_with_a_bpe_tokenizer(tmp_path: Path) -> None:
    """The negative control of the test above: the old resume (the prompt text plus the text
    already sent) continues from other token ids, and so diverges."""
    async with cluster(tmp_path, BPE, workers=1) as (_, _base, sups), \
            aiohttp.ClientSession() as session:
        engine = sups[0].record().engines[0].url
        body = {"prompt": "東京は日本の首都です 😀", "max_tokens": 120, "return_token_ids": True}
        whole = await call(session, engine, False, body)
        ids = whole["token_ids"]
        async with session.post(engine + "/detokenize", json={"tokens": ids[:50]}) as r:
            head = (await r.json())["prompt"]
        by_text = await call(session, engine, False, {**body, "prompt": body["prompt"] + head,
                                                      "max_tokens": 40})
        async with session.post(engine + "/tokenize", json={"prompt": body["prompt"]}) as r:
            prompt_ids = (await r.json())["tokens"]
        by_ids = await call(session, engine, False, {**body, "prompt": prompt_ids + ids[:50],
                                                     "max_tokens": 70})
    assert by_ids["token_ids"] == ids[50:], "resuming after the ids must continue exactly"
    assert by_text["token_ids"] != ids[50:90], "a text resume matched: the control is void"


async def _test_no_max_tokens_returns_what_the_engine_returns(tmp_path: Path) -> None:
    async with cluster(tmp_path, BPE, workers=1) as (_, base, sups), \
            aiohttp.ClientSession() as session:
        engine = sups[0].record().engines[0].url
        body = {"messages": [{"role": "user", "content": "こんにちは"}], "return_token_ids": True}
        direct = await call(session, engine, True, body)
        via = await call(session, base, True, body)
    assert direct["status"] == via["status"] == 200
    assert len(via["token_ids"]) > 16, "cut at the gateway's old default of 16 tokens"
    assert via["text"] == direct["text"] and via["token_ids"] == direct["token_ids"]


async def _test_an_engine_400_reaches_the_client_with_its_status(tmp_path: Path) -> None:
    async with cluster(tmp_path, BPE, workers=1) as (gateway, base, _), \
            aiohttp.ClientSession() as session:
        too_long = {"prompt": "mot " * 10, "max_tokens": 5000}
        whole = await call(session, base, False, too_long)
        streamed = await call(session, base, False, {**too_long, "stream": True})
        fine = await call(session, base, False, {"prompt": "ok", "max_tokens": 5})
    for got in (whole, streamed):
        assert got["status"] == 400, got
        error = got["errors"][0]["error"]
        assert "max" in error["message"].lower() or "context" in error["message"].lower()
    assert fine["status"] == 200, "the engine was marked failed by a client's error"
    assert gateway.counters.engine_errors[400] == 2
    assert gateway.counters.resumes == 0


async def _test_an_exhausted_stream_pool_answers_503_with_retry_after(tmp_path: Path) -> None:
    timing = GatewayTiming(max_streams=2)
    async with cluster(tmp_path, ["--time-scale", "4.0"], workers=1, timing=timing) as (
            gateway, base, _), aiohttp.ClientSession() as session:
        body = {"prompt": "long one", "max_tokens": 200, "stream": True}
        seen = [[0], [0]]
        long = [asyncio.create_task(call(session, base, False, body, seen[i])) for i in (0, 1)]
        while min(s[0] for s in seen) < 1:
            await asyncio.sleep(0.01)
        third = await call(session, base, False, {"prompt": "x", "max_tokens": 3})
        for task in long:
            task.cancel()
        await asyncio.gather(*long, return_exceptions=True)
        await asyncio.sleep(0.2)
        after = await call(session, base, False, {"prompt": "x", "max_tokens": 3})
    assert third["status"] == 503 and third["headers"].get("Retry-After") == "1", third
    assert "max_streams" in third["errors"][0]["error"]["message"]
    assert gateway.counters.rejected["pool_exhausted"] == 1
    assert after["status"] == 200, "streams closed by their clients were not given back"


async def _test_a_stream_broken_long_after_its_start_still_resumes(tmp_path: Path) -> None:
    """The resume deadline runs from the failure: a stream older than it is still resumed."""
    timing = GatewayTiming(recover_within_s=0.3)
    args = ["--tokenizer", "bpe", "--tokens-per-chunk", "4", "--time-scale", "8.0"]
    async with cluster(tmp_path, args, timing=timing) as (
            gateway, base, sups), aiohttp.ClientSession() as session:
        body = {"prompt": "un long récit", "max_tokens": 600, "stream": True,
                "return_token_ids": True}
        reference = await call(session, base, False, body)
        seen = [0]
        started = time.monotonic()
        task = asyncio.create_task(call(session, base, False, body, seen))
        while time.monotonic() - started < 4 * timing.recover_within_s:
            await asyncio.sleep(0.05)
        assert seen[0] and not task.done(), "the stream ended before the kill: make it longer"
        kill_busiest(gateway, sups)
        got = await task
    assert gateway.counters.resumes == 1
    assert got["errors"] == [] and got["token_ids"] == reference["token_ids"]
    assert got["text"] == reference["text"]


async def _test_a_slow_first_token_is_not_a_failure(tmp_path: Path) -> None:
    """A long prefill takes longer than the gap allowed between tokens: the first token has
    its own, longer timeout. Control: with the short timeout for the first token too, the
    same request is taken for a broken engine."""
    prompt = "préfixe " * 40
    for first_token_s, broken in ((30.0, False), (0.05, True)):
        timing = GatewayTiming(first_token_s=first_token_s, token_deadline_s=0.05,
                               recover_within_s=3.0)
        async with cluster(tmp_path / str(first_token_s), [*BPE, "--time-scale", "20"],
                           workers=1, timing=timing) as (gateway, base, _), \
                aiohttp.ClientSession() as session:
            got = await call(session, base, False, {"prompt": prompt, "max_tokens": 2})
        if broken:
            assert got["status"] != 200 or gateway.counters.resumes or gateway.counters.requests[
                "failed"], "the control did not time out: the prefill is not slow enough"
        else:
            assert got["status"] == 200 and gateway.counters.resumes == 0, got
            assert gateway.counters.requests["ok"] == 1


async def _test_a_worker_with_a_shadow_continues_the_stream_itself(tmp_path: Path) -> None:
    async with cluster(tmp_path, [*BPE, "--time-scale", "2.0"], shadows=1) as (
            gateway, base, sups), aiohttp.ClientSession() as session:
        body = {"prompt": "東京 résumé", "max_tokens": 150, "stream": True,
                "return_token_ids": True}
        reference = await call(session, base, False, body)
        seen = [0]
        task = asyncio.create_task(call(session, base, False, body, seen))
        while seen[0] < 10:
            await asyncio.sleep(0.005)
        kill_busiest(gateway, sups)
        got = await task
    assert gateway.counters.routed["shadow"] == 1, gateway.counters.routed
    assert got["token_ids"] == reference["token_ids"] and got["text"] == reference["text"]


def test_bpe_streams_resume_token_identical_across_an_engine_kill(tmp_path: Path) -> None:
    asyncio.run(_test_bpe_streams_resume_token_identical_across_an_engine_kill(tmp_path))


def test_text_resume_is_not_an_id_resume_with_a_bpe_tokenizer(tmp_path: Path) -> None:
    asyncio.run(_test_text_resume_is_not_an_id_resume_with_a_bpe_tokenizer(tmp_path))


def test_no_max_tokens_returns_what_the_engine_returns(tmp_path: Path) -> None:
    asyncio.run(_test_no_max_tokens_returns_what_the_engine_returns(tmp_path))


def test_an_engine_400_reaches_the_client_with_its_status(tmp_path: Path) -> None:
    asyncio.run(_test_an_engine_400_reaches_the_client_with_its_status(tmp_path))


def test_an_exhausted_stream_pool_answers_503_with_retry_after(tmp_path: Path) -> None:
    asyncio.run(_test_an_exhausted_stream_pool_answers_503_with_retry_after(tmp_path))


def test_a_stream_broken_long_after_its_start_still_resumes(tmp_path: Path) -> None:
    asyncio.run(_test_a_stream_broken_long_after_its_start_still_resumes(tmp_path))


def test_a_slow_first_token_is_not_a_failure(tmp_path: Path) -> None:
    asyncio.run(_test_a_slow_first_token_is_not_a_failure(tmp_path))


def test_a_worker_with_a_shadow_continues_the_stream_itself(tmp_path: Path) -> None:
    asyncio.run(_test_a_worker_with_a_shadow_continues_the_stream_itself(tmp_path))


async def _restart_case(tmp_path: Path) -> None:
    """Guided decoding and output-only penalties cannot continue from a prefix: after the
    kill the request is recomputed from its start and the client gets no token twice."""
    async with cluster(tmp_path, [*BPE, "--time-scale", "2.0"]) as (gateway, base, sups), \
            aiohttp.ClientSession() as session:
        bodies = [{"prompt": "{\"clé\": ", "max_tokens": 150, "stream": True,
                   "return_token_ids": True, "response_format": {"type": "json_object"}},
                  {"prompt": "pénalité ", "max_tokens": 150, "stream": True,
                   "return_token_ids": True, "presence_penalty": 0.5}]
        reference = [await call(session, base, False, b) for b in bodies]
        seen = [[0] for _ in bodies]
        tasks = [asyncio.create_task(call(session, base, False, b, seen[i]))
                 for i, b in enumerate(bodies)]
        while min(s[0] for s in seen) < 10:
            await asyncio.sleep(0.005)
        for sup in sups:  # both workers: wherever the two streams run
            if gateway.in_flight[sup.worker.name]:
                active = next(s for s in sup.slots if s.state == "active")
                assert active.proc is not None
                os.kill(active.proc.pid, signal.SIGKILL)
                break
        results = await asyncio.gather(*tasks)
    assert gateway.counters.restarts >= 1, "no request was recomputed from its start"
    for ref, got in zip(reference, results, strict=True):
        assert got["errors"] == [] and got["text"] == ref["text"]
        assert got["token_ids"] == ref["token_ids"]


def test_guided_and_penalised_requests_are_recomputed_without_repeating(
        tmp_path: Path) -> None:
    asyncio.run(_restart_case(tmp_path))


SAMPLED = [{"prompt": f"物語 {i}: ", "max_tokens": 120, "stream": True, "temperature": 1.0,
            "seed": i, "return_token_ids": True} for i in range(16)]


async def _kill_under_sampled_streams(tmp_path: Path) -> tuple[Gateway, list[dict[str, Any]],
                                                               list[str]]:
    """16 sampled streams that asked for their ids, one engine killed under them; each
    stream's ids rendered by an engine afterwards."""
    args = ["--tokenizer", "bpe", "--tokens-per-chunk", "1", "--time-scale", "2.0"]
    async with cluster(tmp_path, args) as (gateway, base, sups), \
            aiohttp.ClientSession() as session:
        seen = [[0] for _ in SAMPLED]
        tasks = [asyncio.create_task(call(session, base, False, body, seen[i]))
                 for i, body in enumerate(SAMPLED)]
        while min(s[0] for s in seen) < 12:
            await asyncio.sleep(0.005)
        victim = kill_busiest(gateway, sups)
        results = await asyncio.gather(*tasks)
        survivor = next(s for s in sups if s is not victim).record().engines[0].url
        rendered = [await emitted_text(session, survivor, got["token_ids"])
                    for got in results]
    return gateway, results, rendered


async def emitted_text(session: aiohttp.ClientSession, url: str, ids: list[int]) -> str:
    """The text an engine's incremental decoder emits for `ids`: their text up to the last
    id after which it is whole (none of a last token's characters when the token ends with
    the first bytes of another; vLLM drops those at the end)."""
    for m in range(len(ids), -1, -1):
        async with session.post(url + "/detokenize", json={"tokens": ids[:m]}) as r:
            text = str((await r.json())["prompt"])
        if not text.endswith("\ufffd"):
            return text
    return ""


async def _test_sampled_streams_broken_inside_a_character_resume_after_their_ids(
        tmp_path: Path) -> None:
    """A sampled stream cannot be generated again, so a break after ids that end inside a
    character (their text not sent yet) must continue after all of them; the engine cannot
    print that character from such a prompt, so the gateway renders it. The client's text is
    then exactly the text of the ids it received."""
    gateway, results, rendered = await _kill_under_sampled_streams(tmp_path)
    assert gateway.counters.resumes >= 1, "no stream was interrupted: the test is void"
    assert gateway.counters.inside_character >= 1, \
        "no stream broke inside a character: the test is void (more streams, longer ones)"
    for got, text in zip(results, rendered, strict=True):
        assert got["status"] == 200 and not got["errors"], got["errors"]
        assert len(got["ids"]) == 1 and got["finish"] == "length"
        assert len(got["token_ids"]) == 120
        assert got["text"] == text, "the text is not that of the ids sent"


async def _test_an_engine_resumed_inside_a_character_prints_the_wrong_text(
        tmp_path: Path) -> None:
    """The control for the test above: asked directly to continue after ids that end inside
    a character, the engine's own text is not the text of those ids."""
    async with cluster(tmp_path, ["--tokenizer", "bpe"], workers=1) as (_, _base, sups), \
            aiohttp.ClientSession() as session:
        engine = sups[0].record().engines[0].url
        body = {"prompt": "物語 0: ", "max_tokens": 60, "return_token_ids": True}
        whole = await call(session, engine, False, body)
        async with session.post(engine + "/tokenize", json={"prompt": body["prompt"]}) as r:
            prompt_ids = (await r.json())["tokens"]
        ids = whole["token_ids"]
        wrong = 0
        for cut in range(1, 40):
            async with session.post(engine + "/detokenize",
                                    json={"tokens": prompt_ids + ids[:cut]}) as r:
                if not (await r.json())["prompt"].endswith("\ufffd"):
                    continue  # a whole character: the engine continues right
            async with session.post(engine + "/detokenize", json={"tokens": ids[:cut]}) as r:
                head = (await r.json())["prompt"].rstrip("\ufffd")
            tail = await call(session, engine, False, {**body, "prompt": prompt_ids + ids[:cut],
                                                       "max_tokens": 10})
            async with session.post(engine + "/detokenize",
                                    json={"tokens": ids[:cut] + tail["token_ids"]}) as r:
                right = (await r.json())["prompt"].rstrip("\ufffd")
            wrong += head + tail["text"] != right
        assert wrong, "every continuation inside a character printed right: the control is void"


def test_sampled_streams_broken_inside_a_character_resume_after_their_ids(
        tmp_path: Path) -> None:
    asyncio.run(_test_sampled_streams_broken_inside_a_character_resume_after_their_ids(
        tmp_path))


def test_an_engine_resumed_inside_a_character_prints_the_wrong_text(tmp_path: Path) -> None:
    asyncio.run(_test_an_engine_resumed_inside_a_character_prints_the_wrong_text(tmp_path))


async def _stalled_client(base: str, gateway: Gateway, wait_s: float) -> float | None:
    """A client that sends a long streamed request and never reads: how long until the
    gateway dropped it and closed its engine stream (None: not within `wait_s`)."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    body = json.dumps({"prompt": "x", "max_tokens": 60000, "stream": True,
                       "logprobs": 5}).encode()  # big chunks fill the buffers sooner
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    started = time.monotonic()
    try:
        while time.monotonic() - started < wait_s:
            if gateway.counters.requests["client_gone"] and not any(gateway.in_flight.values()):
                return time.monotonic() - started
            await asyncio.sleep(0.05)
        return None
    finally:
        sock.close()


async def _test_a_client_that_stops_reading_is_dropped(tmp_path: Path) -> None:
    """A client that reads nothing for [gateway] client_write_s is dropped and its engine
    stream closed (it would hold an engine slot and the gateway's memory). Control: with a
    long client_write_s the same client is still served at twice the time it took."""
    args = ["--time-scale", "0.005", "--tokens-per-chunk", "8"]
    async with cluster(tmp_path / "short", args, workers=1,
                       timing=GatewayTiming(client_write_s=0.5)) as (gateway, base, _):
        took = await _stalled_client(base, gateway, 60.0)
    assert took is not None, "a client that read nothing for 0.5 s was not dropped"
    async with cluster(tmp_path / "long", args, workers=1,
                       timing=GatewayTiming(client_write_s=600.0)) as (gateway, base, _):
        assert await _stalled_client(base, gateway, max(3.0, 2 * took)) is None
        assert gateway.counters.requests["client_gone"] == 0


def test_a_client_that_stops_reading_is_dropped(tmp_path: Path) -> None:
    asyncio.run(_test_a_client_that_stops_reading_is_dropped(tmp_path))
