"""Fixtures for the deployment tests: an sd_notify socket the test owns, lumend processes
started with systemd's environment (NOTIFY_SOCKET, WATCHDOG_USEC) and stopped by pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lumenctl.demo import read_view
from lumenctl.localcluster import EtcdCluster, free_ports, node_config_toml, stop_process
from tests.integration.conftest import etcd, wait_until

from .pki import CertFiles

__all__ = ["etcd", "read_view", "wait_until"]

LAUNCHER = Path(__file__).with_name("lumend_launcher.py")
REPO = Path(__file__).parents[2]


class NotifySocket:
    """An AF_UNIX datagram socket standing in for systemd's notify socket."""

    def __init__(self, address: str) -> None:
        self.address = address  # a path, or "@name" (abstract)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.05)
        self.messages: list[dict[str, str]] = []

    def pump(self) -> list[dict[str, str]]:
        """Read what has arrived; returns the new messages (each as KEY -> value)."""
        new = []
        while True:
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, BlockingIOError):
                break
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            new.append(fields)
        self.messages += new
        return new

    def wait_for(self, key: str, timeout_s: float, what: str, value: str | None = None,
                 after: int = 0) -> int:
        """Index of the first message from `after` on carrying `key` (= `value`)."""
        def probe() -> int | None:
            self.pump()
            for i, m in enumerate(self.messages[after:], after):
                if key in m and (value is None or m[key] == value):
                    return i + 1  # truthy even for index 0
            return None

        return wait_until(probe, timeout_s, what) - 1

    def count(self, key: str, after: int = 0) -> int:
        return sum(1 for m in self.messages[after:] if key in m)

    def statuses(self) -> list[str]:
        return [m["STATUS"] for m in self.messages if "STATUS" in m]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    path = tmp_path / "notify.sock"
    if len(str(path)) > 100:  # sun_path holds 108 bytes
        path = Path(f"/tmp/lumen-notify-{os.getpid()}-{time.monotonic_ns()}.sock")
    sock = NotifySocket(str(path))
    try:
        yield sock
    finally:
        sock.close()
        path.unlink(missing_ok=True)


@pytest.fixture
def abstract_notify_socket() -> Iterator[NotifySocket]:
    sock = NotifySocket(f"@lumen-test-notify-{os.getpid()}-{time.monotonic_ns()}")
    try:
        yield sock
    finally:
        sock.close()


@dataclass
class Lumend:
    """One lumend process run through tests/deploy/lumend_launcher.py."""

    config: Path
    log: Path
    metrics_port: int
    proc: subprocess.Popen[bytes]
    ports: list[int] = field(default_factory=list)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def scrape(self, port: int | None = None) -> str:
        url = f"http://127.0.0.1:{port or self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            body: bytes = response.read()
        return body.decode()


@pytest.fixture
def start_lumend(tmp_path: Path) -> Iterator[Callable[..., Lumend]]:
    """Factory: start_lumend(endpoints, notify=sock, watchdog_usec=..., env={...},
    etcd_tls=CertFiles)."""
    started: list[Lumend] = []

    def start(endpoints: list[str], *, name: str = "n1", cluster: str = "deploy",
              notify: NotifySocket | None = None, watchdog_usec: int | None = None,
              env: dict[str, str] | None = None, workers: int = 1,
              metrics_port: int | None = None, etcd_tls: CertFiles | None = None) -> Lumend:
        ports = free_ports(4 + 2 * workers)
        if metrics_port is not None:
            ports[3] = metrics_port
        config = tmp_path / f"{name}.toml"
        text = node_config_toml(name, endpoints, cluster, ports, lease_ttl_s=3,
                                workers=workers, workdir=tmp_path)
        if etcd_tls is not None:
            text = text.replace("[etcd]\n", f'[etcd]\nca_cert = "{etcd_tls.ca}"\n'
                                f'cert = "{etcd_tls.cert}"\nkey = "{etcd_tls.key}"\n', 1)
        config.write_text(text)
        environ = {k: v for k, v in os.environ.items()
                   if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID",
                                "JOURNAL_STREAM")}
        environ["PYTHONPATH"] = str(REPO)
        if notify is not None:
            environ["NOTIFY_SOCKET"] = notify.address
        if watchdog_usec is not None:
            environ["WATCHDOG_USEC"] = str(watchdog_usec)
        environ.update(env or {})
        log = tmp_path / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, str(LAUNCHER), "--config", str(config)],
                stdout=out, stderr=subprocess.STDOUT, env=environ, start_new_session=True,
            )
        node = Lumend(config, log, ports[3], proc, ports)
        started.append(node)
        return node

    try:
        yield start
    finally:
        for node in started:
            stop_process(node.proc)


def metric_value(exposition: str, name: str) -> float:
    """The value of an unlabelled sample `name` in a Prometheus text exposition."""
    for line in exposition.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(f"{name} not in the scrape")


def unused_etcd(tmp_path: Path) -> EtcdCluster:
    """An etcd member whose ports are chosen but which is not started yet."""
    return EtcdCluster(tmp_path / "etcd-late", size=1)
