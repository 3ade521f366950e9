"""Both roles of draft-assist on real processes: a sim engine (survivor) attached through
POST /lumen/assist to a sim draft server (`python -m lumend.assist.sim_drafter`).

Output must be the target's whatever the drafter does: a perfect drafter gets every drafted
token accepted, a noisy one some, one slower than the deadline none (and no hang)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from lumenctl.localcluster import free_ports, stop_process
from lumend.engine.sim_core import decode, encode, reference_completion

PROMPTS = [f"request {i}: tell me about speculative decoding" for i in range(6)]
MAX_TOKENS = 48


class Engine:
    def __init__(self, tmp: Path) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "lumend.engine.sim_server", "--engine-id", "s/0",
               "--port", str(self.port), "--time-scale", "1.0"]
        with (tmp / "engine.log").open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while self.info().get("state") != "active":
            assert self.proc.poll() is None, "the engine exited"
            assert time.monotonic() < deadline, "the engine never became active"
            time.sleep(0.05)

    def info(self) -> dict[str, Any]:
        try:
            return dict(self.call("GET", "/lumen/engine")[1])
        except OSError:
            return {}

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def complete_all(self) -> list[str]:
        def one(prompt: str) -> str:
            status, body = self.call("POST", "/v1/completions",
                                     {"prompt": prompt, "max_tokens": MAX_TOKENS})
            assert status == 200, body
            return str(body["choices"][0]["text"])

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            return list(pool.map(one, PROMPTS))

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return str(r.read().decode())


class Drafter:
    def __init__(self, tmp: Path, name: str, *args: str) -> None:
        self.port = free_ports(1)[0]
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        ready = tmp / f"{name}.endpoint"
        cmd = [sys.executable, "-m", "lumend.assist.sim_drafter", "--listen",
               f"127.0.0.1:{self.port}", "--endpoint-file", str(ready), *args]
        self.log = tmp / f"{name}.log"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not ready.exists():  # serving once it wrote its endpoint
            assert self.proc.poll() is None, f"drafter {name} exited"
            assert time.monotonic() < deadline, f"drafter {name} never served"
            time.sleep(0.05)
        assert ready.read_text().strip() == self.endpoint


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = Engine(tmp_path)
    try:
        yield e
    finally:
        stop_process(e.proc)


@pytest.fixture
def drafter(tmp_path: Path) -> Iterator[Callable[..., Drafter]]:
    made: list[Drafter] = []

    def make(name: str, *args: str) -> Drafter:
        d = Drafter(tmp_path, name, *args)
        made.append(d)
        return d

    try:
        yield make
    finally:
        for d in made:
            stop_process(d.proc)


def expected() -> list[str]:
    return [decode(reference_completion(0, encode(p), MAX_TOKENS)) for p in PROMPTS]


def assisted(engine: Engine, d: Drafter, deadline_ms: float, k: int = 4) -> dict[str, Any]:
    """Attach, run the prompts (checking the output), detach; the assignment's counters."""
    status, body = engine.call("POST", "/lumen/assist",
                               {"endpoint": d.endpoint, "assignment": d.log.stem, "k": k,
                                "deadline_ms": deadline_ms, "max_batch": 16})
    assert status == 200, body
    assert engine.complete_all() == expected()
    status, body = engine.call("DELETE", "/lumen/assist")
    assert status == 200 and body["attached"] is False
    return dict(body["assignments"][d.log.stem])


def test_output_without_a_drafter_is_the_reference(engine: Engine) -> None:
    assert engine.complete_all() == expected()
    assert engine.info()["assist"]["attached"] is False


def test_a_perfect_drafter_gets_every_draft_accepted(engine: Engine,
                                                     drafter: Callable[..., Drafter]) -> None:
    steps_before = _metric(engine.metrics(), "lumen_sim_steps_total")
    d = drafter("perfect", "--agreement", "1.0")
    c = assisted(engine, d, deadline_ms=200)
    assert c["drafted_tokens"] > 0
    assert c["accepted_tokens"] == c["drafted_tokens"] and c["acceptance"] == 1.0
    # Accepted drafts are tokens committed without a step of their own.
    steps = _metric(engine.metrics(), "lumen_sim_steps_total") - steps_before
    assert steps < len(PROMPTS) * MAX_TOKENS
    text = engine.metrics()
    assert (f'lumen_assist_accepted_tokens_total{{assignment="perfect"}} '
            f'{c["accepted_tokens"]}') in text


def test_a_noisy_drafter_gets_some_accepted(engine: Engine,
                                            drafter: Callable[..., Drafter]) -> None:
    d = drafter("noisy", "--agreement", "0.5", "--draft-seed", "7")
    c = assisted(engine, d, deadline_ms=200)
    assert c["drafted_tokens"] > 0
    assert 0 < c["accepted_tokens"] < c["drafted_tokens"]


def test_a_drafter_slower_than_the_deadline_is_not_used(
        engine: Engine, drafter: Callable[..., Drafter]) -> None:
    # 2 s per drafted token: no round can be answered within 5 ms.
    d = drafter("slow", "--agreement", "1.0", "--seconds-per-token", "2.0")
    c = assisted(engine, d, deadline_ms=5)
    assert c["rounds"] > 0 and c["late_rounds"] == c["rounds"]
    assert c["drafted_tokens"] == 0 and c["accepted_tokens"] == 0


def test_a_drafter_that_is_gone_costs_nothing_but_the_deadline(
        engine: Engine, drafter: Callable[..., Drafter]) -> None:
    d = drafter("gone", "--agreement", "1.0")
    stop_process(d.proc)
    c = assisted(engine, d, deadline_ms=5)
    assert c["drafted_tokens"] == 0 and c["late_rounds"] == c["rounds"]


@pytest.mark.parametrize("body,field", [
    ({"endpoint": "http://x:1"}, "endpoint"),
    ({"endpoint": "tcp://127.0.0.1:5", "k": 0}, "k"),
    ({"endpoint": "tcp://127.0.0.1:5", "k": 99}, "k"),
    ({"endpoint": "tcp://127.0.0.1:5", "deadline_ms": -1}, "deadline_ms"),
    ({"endpoint": "tcp://127.0.0.1:5", "max_batch": "many"}, "max_batch"),
    (["tcp://127.0.0.1:5"], "body"),
])
def test_a_bad_attach_is_refused_naming_the_field(engine: Engine, body: Any,
                                                  field: str) -> None:
    status, reply = engine.call("POST", "/lumen/assist", body)
    assert status == 400 and f"{field}:" in reply["error"]["message"]
    assert engine.info()["assist"]["attached"] is False


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the engine's metrics")
