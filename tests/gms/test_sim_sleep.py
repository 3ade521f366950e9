"""The sim engine's vLLM-style sleep and wake, on real engine and GMS processes: sleep
frees the KV pool (level 1) and the weights (level 2), requests get 503 at once while it
sleeps, and wake maps the weights from GMS again instead of reading them from disk."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lumenctl.localcluster import free_ports, stop_process
from lumend.engine.sim_core import SleepState, decode, encode, reference_completion

from .conftest import GmsProcess

PROMPT = "sleep frees memory; wake maps the weights again"


class Engine:
    def __init__(self, tmp: Path, name: str, gms: GmsProcess | None) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "lumend.engine.sim_server", "--engine-id", name,
               "--port", str(self.port), "--time-scale", "0.2"]
        if gms is not None:
            cmd += ["--gms-socket", str(gms.socket)]
        with (tmp / f"{name}.log").open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while self.info().get("state") != "active":
            assert self.proc.poll() is None, f"engine {name} exited"
            assert time.monotonic() < deadline, f"engine {name} never became active"
            time.sleep(0.05)

    def info(self) -> dict[str, Any]:
        try:
            return dict(self.get("/lumen/engine")[1])
        except OSError:
            return {}

    def get(self, path: str) -> tuple[int, Any]:
        return self.call("GET", path)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             timeout: float = 30) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def complete(self, max_tokens: int = 12) -> tuple[int, Any]:
        return self.call("POST", "/v1/completions",
                         {"prompt": PROMPT, "max_tokens": max_tokens})

    def tokens_generated(self) -> int:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        match = re.search(r"^lumen_sim_tokens_generated_total (\d+)$", text, re.M)
        assert match, "the sim engine's metrics lack lumen_sim_tokens_generated_total"
        return int(match.group(1))

    def sleeping(self) -> bool:
        return bool(self.get("/is_sleeping")[1]["is_sleeping"])

    def digest(self) -> tuple[int, Any]:
        return self.get("/lumen/weights_digest")


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[Engine]]:
    started: list[Engine] = []
    try:
        yield started
    finally:
        for e in started:
            stop_process(e.proc)


def expected_text(max_tokens: int = 12) -> str:
    return decode(reference_completion(0, encode(PROMPT), max_tokens))


def test_sleep_and_wake_remap_the_weights_from_gms(
        gms: GmsProcess, engines: list[Engine], tmp_path: Path) -> None:
    writer = Engine(tmp_path, "a", gms)
    engines.append(writer)
    shadow = Engine(tmp_path, "b", gms)  # maps what `a` published
    engines.append(shadow)
    assert writer.info()["weight_loads"] == {"disk": 1, "gms": 0}
    assert shadow.info()["weight_loads"] == {"disk": 0, "gms": 1}
    digest = shadow.digest()[1]["digest"]
    assert writer.digest()[1]["digest"] == digest

    for engine in (writer, shadow):
        # Level 1: the KV pool goes, the weights stay mapped; requests are refused at once.
        assert engine.call("POST", "/sleep?level=1") == (200, {"status": "sleeping",
                                                                "level": 1})
        assert engine.sleeping()
        assert engine.info()["memory"] == ["weights"]
        status, body = engine.call("POST", "/v1/completions",  # refused, not held
                                   {"prompt": PROMPT, "max_tokens": 4}, timeout=10)
        assert status == 503 and "asleep" in body["error"]["message"]
        assert engine.digest()[1]["digest"] == digest
        assert engine.call("POST", "/wake_up")[1]["status"] == "awake"
        assert not engine.sleeping() and engine.complete()[1]["choices"][0]["text"] == (
            expected_text())

        # Level 2: the weights go too (the engine leaves GMS), wake maps them again.
        before = gms.stats()
        assert engine.call("POST", "/sleep?level=2")[0] == 200
        assert engine.info()["memory"] == []
        assert engine.digest()[0] == 503
        assert gms.stats()["readers"] == before["readers"] - 1
        # Weights only: still asleep until the KV cache is back too.
        assert engine.call("POST", "/wake_up?tags=weights")[1] == {"status": "sleeping",
                                                                    "tags": ["weights"]}
        assert engine.complete()[0] == 503
        assert engine.call("POST", "/wake_up?tags=kv_cache")[1]["status"] == "awake"
        after = gms.stats()
        assert after["reader_sessions"] == before["reader_sessions"] + 1
        assert after["commits"] == 1 and after["readers"] == before["readers"]
        assert engine.digest()[1]["digest"] == digest
        assert engine.complete()[1]["choices"][0]["text"] == expected_text()

    # Not one reload from disk: the writer read the weights once, the shadow never.
    assert writer.info()["weight_loads"] == {"disk": 1, "gms": 1}
    assert shadow.info()["weight_loads"] == {"disk": 0, "gms": 2}


def test_without_gms_level_two_reloads_from_disk(engines: list[Engine],
                                                 tmp_path: Path) -> None:
    # The negative control of the counters above: a reload from disk is visible.
    engine = Engine(tmp_path, "solo", None)
    engines.append(engine)
    digest = engine.digest()[1]["digest"]
    assert engine.call("POST", "/sleep?level=2")[0] == 200
    assert engine.call("POST", "/wake_up")[1]["status"] == "awake"
    assert engine.info()["weight_loads"] == {"disk": 2, "gms": 0}
    assert engine.digest()[1]["digest"] == digest


def test_sleep_ends_running_streams_and_rejects_bad_input(
        engines: list[Engine], tmp_path: Path) -> None:
    engine = Engine(tmp_path, "solo", None)
    engines.append(engine)
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["reply"] = engine.complete(max_tokens=100_000)

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 30
    # Running is not enough: a request admitted but not yet past its first step ends with
    # no text at all, and the partial reply is what this test is about.
    while engine.info().get("running", 0) == 0 or engine.tokens_generated() == 0:
        assert time.monotonic() < deadline, "the request never produced a token"
        time.sleep(0.02)
    assert engine.call("POST", "/sleep?level=1&mode=abort")[0] == 200
    worker.join(timeout=30)
    assert not worker.is_alive(), "a request running at sleep was left hanging"
    status, body = result["reply"]
    assert status == 200 and 0 < len(body["choices"][0]["text"]) < 100_000
    for bad in ("/sleep?level=3", "/sleep?level=x", "/sleep?mode=later"):
        status, body = engine.call("POST", bad)
        assert status == 400, bad
    assert engine.call("POST", "/wake_up?tags=gpu")[0] == 400
    assert engine.call("POST", "/wake_up")[1]["status"] == "awake"
    assert engine.complete()[0] == 200


def test_sleep_state_follows_vllm_levels_and_tags() -> None:
    s = SleepState()
    assert s.sleep(0) == [] and s.sleeping
    assert s.wake() == [] and not s.sleeping
    assert s.sleep(1) == ["kv_cache"] and s.sleep(2) == ["weights"] and s.level == 2
    assert s.wake(["kv_cache"]) == ["kv_cache"] and s.sleeping
    assert s.wake(["weights"]) == ["weights"] and not s.sleeping
    with pytest.raises(ValueError, match="sleep level"):
        s.sleep(5)
    with pytest.raises(ValueError, match="unknown wake tag"):
        s.wake(["gpu"])
