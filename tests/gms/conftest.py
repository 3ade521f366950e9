"""A real GMS server process (host backend) on a socket in the test's directory."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lumenctl.localcluster import stop_process
from lumend.gms.client import GmsClient, GmsError


@dataclass
class GmsProcess:
    socket: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self) -> GmsClient:
        return GmsClient(self.socket)

    def stats(self) -> dict[str, object]:
        with self.client() as c:
            return c.stats()


def start_gms(tmp_path: Path, name: str = "gms") -> GmsProcess:
    sock = tmp_path / f"{name}.sock"
    log = tmp_path / f"{name}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lumend.gms.server", "--socket", str(sock)],
            stdout=out, stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 20
    while True:
        try:
            GmsClient(sock).close()
            return GmsProcess(sock, proc, log)
        except GmsError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                pytest.fail(f"GMS server did not start: {log.read_text()}")
            time.sleep(0.02)


@pytest.fixture
def gms(tmp_path: Path) -> Iterator[GmsProcess]:
    server = start_gms(tmp_path)
    try:
        yield server
    finally:
        stop_process(server.proc)
