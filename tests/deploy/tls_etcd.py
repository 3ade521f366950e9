"""One etcd member that serves clients and peers over TLS and requires client certificates
(the way ansible/roles/etcd runs it), started from the `etcd` binary and stopped by pid."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from lumenctl.localcluster import etcd_binary, free_ports, stop_process

from .pki import CertFiles


class TlsEtcd:
    def __init__(self, workdir: Path, member: CertFiles) -> None:
        self.workdir = workdir
        self.member = member
        self.client_port, self.peer_port = free_ports(2)
        self.log_path = workdir / "etcd-tls.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 20.0) -> TlsEtcd:
        peer = f"https://127.0.0.1:{self.peer_port}"
        m = self.member
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [etcd_binary(), "--name", "tls0", "--data-dir", str(self.workdir / "tls0.data"),
                 "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"tls0={peer}", "--initial-cluster-state", "new",
                 "--initial-cluster-token", f"lumen-tls-{os.getpid()}",
                 "--cert-file", str(m.cert), "--key-file", str(m.key),
                 "--trusted-ca-file", str(m.ca), "--client-cert-auth",
                 "--peer-cert-file", str(m.cert), "--peer-key-file", str(m.key),
                 "--peer-trusted-ca-file", str(m.ca), "--peer-client-cert-auth"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while "ready to serve client requests" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not ready after {timeout_s} s; see {self.log_path}")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
