"""The gate's sleep-mode protocol (GPU engines): a standby is asleep before it reports
`standby`, wakes when it takes the failover lock, and an active engine handed over sleeps
before it releases the lock, so two engines never hold the GPU's KV cache at once.

And who may drive an engine: its control paths (vLLM's dev endpoints, /lumen/release) are
served only to a peer on this machine with the engine's token; /v1/* to anyone."""

from __future__ import annotations

import http.client
import json
import os
import socket
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
from lumend.engine.engine_auth import TOKEN_ENV, TOKEN_HEADER


class GatedEngine:
    def __init__(self, name: str, lock: Path, logs: Path, *, host: str = "127.0.0.1",
                 sleep_mode: bool = True) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = f"token-of-{name}"
        env = {**os.environ, "LUMEN_ENGINE_ID": name, "LUMEN_FAILOVER_LOCK": str(lock),
               "LUMEN_ENGINE_URL": self.url, TOKEN_ENV: self.token}
        if sleep_mode:
            env["LUMEN_SLEEP_MODE"] = "1"
        env.pop("LUMEN_SUPERVISOR_PID", None)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("gate_app.py")), str(self.port),
             host],
            env=env, stdout=(logs / f"{name.replace('/', '-')}.log").open("ab"),
            stderr=subprocess.STDOUT)

    def get(self, path: str) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, headers={TOKEN_HEADER: self.token})
        with urllib.request.urlopen(request, timeout=5) as r:
            return dict(json.load(r))

    def post(self, path: str) -> int:
        request = urllib.request.Request(self.url + path, data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json",
                                                  TOKEN_HEADER: self.token})
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


def call(host: str, port: int, method: str, path: str, *, token: str | None = None,
         source: str | None = None) -> tuple[int, dict[str, Any]]:
    """One request from `source` (a local address to send from) to host:port."""
    connection = http.client.HTTPConnection(
        host, port, timeout=10, source_address=(source, 0) if source else None)
    try:
        headers = {"Content-Type": "application/json", **({TOKEN_HEADER: token} if token else {})}
        connection.request(method, path, body=b"{}" if method == "POST" else None,
                           headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def non_loopback_ipv4() -> str:
    psutil = pytest.importorskip("psutil")
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    pytest.skip("this machine has no non-loopback IPv4 address to send from")


@pytest.fixture
def open_engine(tmp_path: Path) -> Iterator[GatedEngine]:
    """An active engine listening on every address, as one reachable by other gateways."""
    engine = GatedEngine("w1/0", tmp_path / "failover.lock", tmp_path, host="0.0.0.0",
                         sleep_mode=False)
    try:
        wait_for(lambda: engine.state() == "active", "the engine never became active")
        yield engine
    finally:
        stop_process(engine.proc)


def test_control_paths_are_lumends_alone_and_completions_anyone_s(
    open_engine: GatedEngine,
) -> None:
    engine, port, outside = open_engine, open_engine.port, non_loopback_ipv4()

    # From another address (sent from this machine's non-loopback IP to its loopback: a
    # peer that is neither loopback nor the address it called), even with the token.
    for method, path in (("POST", "/lumen/release"), ("POST", "/collective_rpc"),
                         ("POST", "/sleep?level=1"), ("POST", "/v1/load_lora_adapter")):
        status, body = call("127.0.0.1", port, method, path, token=engine.token,
                            source=outside)
        assert status == 403, (path, status)
        assert body["error"]["code"] == 403 and f"not to {outside}" in body["error"]["message"]
    # Inference, probes and the engine's state stay open to it.
    assert call("127.0.0.1", port, "POST", "/v1/completions", source=outside)[0] == 200
    assert call("127.0.0.1", port, "GET", "/lumen/engine", source=outside)[0] == 200
    # From this machine without the token, or with another engine's: refused too.
    status, body = call("127.0.0.1", port, "POST", "/collective_rpc")
    assert status == 403 and TOKEN_HEADER in body["error"]["message"]
    assert call("127.0.0.1", port, "POST", "/collective_rpc", token="token-of-w0/0")[0] == 403
    assert engine.calls() == []  # none of them reached the server behind the gate

    # lumend: from loopback, and from the node's address it calls its engines at.
    assert call("127.0.0.1", port, "POST", "/collective_rpc", token=engine.token)[0] == 200
    assert call(outside, port, "POST", "/collective_rpc", token=engine.token)[0] == 200
    assert engine.calls() == ["collective_rpc", "collective_rpc"]
    counts = engine.get("/lumen/engine")["control_refused"]
    assert counts == {"remote": 4, "no_token": 1, "bad_token": 1}
    status, _ = call("127.0.0.1", port, "POST", "/lumen/release?drain_timeout_s=1",
                     token=engine.token)
    assert status == 200
    # Released; with no shadow to take the lock, the engine takes it back.
    wait_for(lambda: engine.state() == "active", "the released engine never took the lock back")
