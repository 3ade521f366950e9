"""The gate's sleep-mode protocol (GPU engines): a standby is asleep before it reports
`standby`, wakes when it takes the failover lock, and an active engine handed over sleeps
before it releases the lock, so two engines never hold the GPU's KV cache at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lumenctl.localcluster import free_ports, stop_process


class GatedEngine:
    def __init__(self, name: str, lock: Path, logs: Path) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "LUMEN_ENGINE_ID": name, "LUMEN_FAILOVER_LOCK": str(lock),
               "LUMEN_SLEEP_MODE": "1", "LUMEN_ENGINE_URL": self.url}
        env.pop("LUMEN_SUPERVISOR_PID", None)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("gate_app.py")), str(self.port)],
            env=env, stdout=(logs / f"{name.replace('/', '-')}.log").open("ab"),
            stderr=subprocess.STDOUT)

    def get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return dict(json.load(r))

    def post(self, path: str) -> int:
        request = urllib.request.Request(self.url + path, data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def state(self) -> str:
        try:
            return str(self.get("/lumen/engine")["state"])
        except OSError:
            return "down"

    def calls(self) -> list[str]:
        return list(self.get("/calls")["calls"])


def wait_for(predicate: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[tuple[GatedEngine, GatedEngine]]:
    lock = tmp_path / "failover.lock"
    a = GatedEngine("w0/0", lock, tmp_path)
    wait_for(lambda: a.state() == "active", "the first engine never became active")
    b = GatedEngine("w0/1", lock, tmp_path)
    try:
        yield a, b
    finally:
        stop_process(a.proc)
        stop_process(b.proc)


def test_standby_sleeps_wakes_on_the_lock_and_the_old_active_sleeps_first(
    engines: tuple[GatedEngine, GatedEngine],
) -> None:
    a, b = engines
    wait_for(lambda: b.state() == "standby", "the second engine never stood by")
    assert a.calls() == ["sleep:1", "wake_up"]  # slept once initialised, woke with the lock
    assert b.calls() == ["sleep:1"]  # asleep while it waits: no KV cache on the GPU
    assert b.post("/v1/completions") == 503 and a.post("/v1/completions") == 200

    assert a.post("/lumen/release?drain_timeout_s=5") == 200
    wait_for(lambda: b.state() == "active", "the standby never took over")
    assert a.calls() == ["sleep:1", "wake_up", "sleep:1"]  # asleep before the hand-over
    assert b.calls() == ["sleep:1", "wake_up"]
    assert a.state() == "standby" and b.post("/v1/completions") == 200
