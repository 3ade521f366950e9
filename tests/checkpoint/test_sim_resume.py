"""The sim engine streams a request's KV blocks to a real holder; its engine is SIGKILLed
mid-decode; a fresh engine resumes the request from the holder's pages (byte-checked) and
computes only the tail, continuing exactly as the failure-free run would have."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lumenctl.localcluster import free_ports, stop_process
from lumend.checkpoint.streamer import CheckpointStreamer
from lumend.engine.sim_checkpoint import CheckpointPlan, SimCheckpointer, is_kv_page
from lumend.engine.sim_core import (
    BLOCK_SIZE,
    block_hashes,
    decode,
    encode,
    kv_page,
    reference_completion,
)
from lumend.engine.sim_models import sim_model

from .conftest import MakeHolder, RunningHolder, held_blocks

PROMPT = "the holder keeps what the engine computed, block by block, " * 2
MAX_TOKENS = 200
LATE_HOLDER_AFTER = 30  # tokens streamed before the late holder starts


class Engine:
    def __init__(self, tmp: Path, name: str, seed: int = 0) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        log = (tmp / f"{name}.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lumend.engine.sim_server", "--engine-id", name,
             "--port", str(self.port), "--seed", str(seed), "--time-scale", "3.0"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while self.info().get("state") != "active":
            assert time.monotonic() < deadline, f"engine {name} never became active"
            time.sleep(0.05)

    def info(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.url + "/lumen/engine", timeout=2) as r:
                return dict(json.load(r))
        except OSError:
            return {}

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(name)

    def post(self, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(self.url + "/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=60)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[Engine]]:
    started: list[Engine] = []
    try:
        yield started
    finally:
        for e in started:
            stop_process(e.proc)


def plan(holder: str, mode: str) -> dict[str, Any]:
    return {"lumen": {"ckpt_id": "req-1", "holder": holder, "worker": "h0", "mode": mode}}


def test_resume_from_the_holder_recomputes_only_the_tail(
    make_holder: MakeHolder, engines: list[Engine], tmp_path: Path,
) -> None:
    holder = make_holder(budget_bytes=64 << 20, workers=("h0",))
    a = Engine(tmp_path, "a")
    engines.append(a)
    reference = decode(reference_completion(0, encode(PROMPT), MAX_TOKENS))

    # Engine A streams the request, saving to the holder; it dies after 60 tokens.
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
            "kv_transfer_params": plan(holder.endpoint, "save")}
    received = ""
    with a.post(body) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                received += json.loads(line[6:])["choices"][0]["text"]
            if len(received) == 60:
                a.proc.send_signal(signal.SIGKILL)
                break
    a.proc.wait(timeout=10)
    assert received == reference[:60]
    stats = holder.stats()
    assert stats.workers["h0"].requests == 1 and stats.workers["h0"].bytes_held > 0

    # Engine B resumes: prompt + the text already sent; the holder's blocks are loaded.
    b = Engine(tmp_path, "b")
    engines.append(b)
    resumed_prompt = encode(PROMPT + received)
    with b.post({"prompt": PROMPT + received, "max_tokens": MAX_TOKENS - 60,
                 "kv_transfer_params": plan(holder.endpoint, "resume")}) as response:
        text = json.load(response)["choices"][0]["text"]
    assert received + text == reference, "the resumed stream differs from the failure-free one"
    restored = b.metric("lumen_sim_restored_tokens_total")
    full_blocks = len(block_hashes(0, resumed_prompt))
    assert restored >= BLOCK_SIZE * (full_blocks - 2), "most blocks should have been saved"
    assert b.metric("lumen_sim_restore_mismatches_total") == 0
    # Only the tail was computed: the prompt minus what was restored.
    assert b.metric("lumen_sim_prefill_tokens_total") == len(resumed_prompt) - restored
    # The resumed request ended: its checkpoint was freed.
    deadline = time.monotonic() + 10
    while holder.stats().workers["h0"].requests:
        assert time.monotonic() < deadline, "FINISH did not free the checkpoint"
        time.sleep(0.05)


def test_corrupted_pages_are_not_used(
    make_holder: MakeHolder, engines: list[Engine], tmp_path: Path,
) -> None:
    """Negative control for the byte check: the holder has every block of the prompt, under
    the right hashes, but one page's bytes are wrong. The engine loads the blocks before it
    and recomputes from there, counts the mismatch, and answers correctly."""
    holder = make_holder(budget_bytes=64 << 20, workers=("h0",))
    saver = SimCheckpointer(sim_model("sim-small"), seed=0)
    streamer = CheckpointStreamer(holder.endpoint, saver.layout)
    assert streamer.wait_connected(10)
    hashes = block_hashes(0, encode(PROMPT))
    bad = 2
    for i, h in enumerate(hashes):
        page = bytearray(kv_page(h, saver.page_bytes))
        if i == bad:
            page[100] ^= 0xFF  # one flipped byte
        assert streamer.put_block(ckpt_id="req-1", request_id="r", worker="h0", block_index=i,
                                  block_hash=h, page=bytes(page),
                                  token_count=(i + 1) * BLOCK_SIZE)
    assert streamer.wait_acks("req-1", 10).complete
    streamer.close()

    c = Engine(tmp_path, "c")
    engines.append(c)
    with c.post({"prompt": PROMPT, "max_tokens": 20,
                 "kv_transfer_params": plan(holder.endpoint, "resume")}) as response:
        text = json.load(response)["choices"][0]["text"]
    assert text == decode(reference_completion(0, encode(PROMPT), 20))
    assert c.metric("lumen_sim_restore_mismatches_total") == 1
    assert c.metric("lumen_sim_restored_tokens_total") == bad * BLOCK_SIZE
    assert c.metric("lumen_sim_prefill_tokens_total") == len(encode(PROMPT)) - bad * BLOCK_SIZE


@pytest.mark.parametrize("page_bytes", [64, 1000, 16 * 16 * 1024])
def test_the_page_check_is_a_byte_for_byte_comparison(page_bytes: int) -> None:
    """`is_kv_page` (no expected page built) agrees with comparing against `kv_page`."""
    rng = random.Random(page_bytes)
    h = block_hashes(0, encode(PROMPT))[0]
    good = kv_page(h, page_bytes)
    assert is_kv_page(memoryview(good), h, page_bytes)
    other = block_hashes(0, encode(PROMPT))[1]
    assert not is_kv_page(memoryview(kv_page(other, page_bytes)), h, page_bytes)
    assert not is_kv_page(memoryview(good[:-1]), h, page_bytes)
    assert not is_kv_page(memoryview(good[1:] + good[:1]), h, page_bytes)  # shifted by one
    for _ in range(50):
        bad = bytearray(good)
        bad[rng.randrange(page_bytes)] ^= 1 << rng.randrange(8)
        assert not is_kv_page(memoryview(bytes(bad)), h, page_bytes)


def test_a_holder_that_connects_late_still_gets_the_checkpoint_from_its_first_block(
        engines: list[Engine], tmp_path: Path) -> None:
    """The request is admitted at once though its holder is not up (it used to wait up to
    1 s for the connection, stalling its first token): the pages saved meanwhile wait in
    the engine and reach the holder from block 0 once it starts, so the checkpoint is
    usable. tests/checkpoint/test_streamer.py has the negative control (a streamer without
    the grace loses them); tests/vllm/test_vllm_connector.py the same test on vLLM."""
    from lumend.checkpoint.holder import HolderConfig

    a = Engine(tmp_path, "a")
    engines.append(a)
    (port,) = free_ports(1)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
            "kv_transfer_params": {"lumen": {"ckpt_id": "late", "mode": "save", "worker": "h0",
                                             "holder": f"tcp://127.0.0.1:{port}"}}}
    late: list[RunningHolder] = []
    # The blocks full when the holder starts (computed KV: prompt + tokens seen - 1).
    expected = (len(encode(PROMPT)) + LATE_HOLDER_AFTER - 1) // BLOCK_SIZE
    held, received = 0, 0
    try:
        with a.post(body) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                received += len(json.loads(line[6:])["choices"][0]["text"])
                if not late and received >= LATE_HOLDER_AFTER:
                    late.append(RunningHolder(HolderConfig(
                        listen=f"127.0.0.1:{port}", workers=("h0",),
                        budget_bytes=64 << 20)).start())
                if late and (held := held_blocks(late[0], "late")) >= expected:
                    break
        assert late, f"the stream ended after {received} characters"
        assert held >= expected, (f"the late holder held {held} of the {expected} blocks "
                                  f"full when it started, by the end of the stream")
    finally:
        for running in late:
            running.stop()


def save_plan(holder: str) -> CheckpointPlan:
    return CheckpointPlan("req-1", holder, "h0", "save")
