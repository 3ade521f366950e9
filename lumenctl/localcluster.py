"""A LUMEN cluster on this machine: etcd members and lumend processes on loopback ports.

Used by `lumenctl demo`, the integration tests and the benchmarks. Every process it starts
it stops itself, by pid: SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lumend.checkpoint.security import CurveKeys

ETCD_INSTALL_HINT = (
    "the etcd server binary was not found on PATH; install it "
    "(Debian/Ubuntu: `apt-get install -y etcd-server`) or set LUMEN_ETCD_BIN"
)


# etcd's own hygiene in a local cluster, as the etcd role should set it in production:
# history older than the retention is compacted by etcd itself (the coordinator also
# compacts, fenced), and the backend's quota is explicit, so NOSPACE comes at a known size.
ETCD_AUTO_COMPACTION_RETENTION = "5m"
ETCD_QUOTA_BACKEND_BYTES = 1 << 30


def free_ports(count: int) -> list[int]:
    """Ports the kernel hands out as free right now (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port_run(count: int, low: int = 20000, high: int = 32000) -> int:
    """The first of `count` consecutive ports that are free now, below the kernel's
    ephemeral range (32768 and up by default): a worker's engines listen on `port ..
    port + shadows`, and a port in the ephemeral range can be taken meanwhile by any
    outgoing connection (an engine that then cannot bind, and a flaky cluster)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports between {low} and {high}")


def etcd_binary() -> str:
    found = os.environ.get("LUMEN_ETCD_BIN") or shutil.which("etcd")
    if not found:
        raise RuntimeError(ETCD_INSTALL_HINT)
    return found


def process_running(pid: int | None) -> bool:
    """`pid` runs: it exists and is not a zombie (an exited process whose parent, or the
    reaper of an orphan, has not collected it yet) or dead."""
    if pid is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGCONT)  # a SIGSTOPped process cannot handle SIGTERM
        proc.terminate()
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        pass


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


class EtcdCluster:
    """One or more etcd members on loopback, each with its own data directory.

    `auto_compaction_retention` (etcd's periodic mode; None: no auto-compaction) and
    `quota_backend_bytes` (None: etcd's default, 2 GiB) are etcd's hygiene flags."""

    def __init__(self, workdir: Path, size: int = 1, *,
                 auto_compaction_retention: str | None = ETCD_AUTO_COMPACTION_RETENTION,
                 quota_backend_bytes: int | None = ETCD_QUOTA_BACKEND_BYTES) -> None:
        self.workdir = workdir
        self.auto_compaction_retention = auto_compaction_retention
        self.quota_backend_bytes = quota_backend_bytes
        self.data_root = data_root_for(workdir)
        ports = free_ports(2 * size)
        self.members = [
            EtcdMember(
                name=f"etcd{i}",
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                data_dir=self.data_root / f"etcd{i}.data",
                log_path=workdir / f"etcd{i}.log",
            )
            for i in range(size)
        ]

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    def start(self, timeout_s: float = 20.0) -> EtcdCluster:
        binary = etcd_binary()
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.data_root.mkdir(parents=True, exist_ok=True)
        hygiene: list[str] = []
        if self.auto_compaction_retention is not None:
            hygiene += ["--auto-compaction-mode", "periodic",
                        "--auto-compaction-retention", self.auto_compaction_retention]
        if self.quota_backend_bytes is not None:
            hygiene += ["--quota-backend-bytes", str(self.quota_backend_bytes)]
        for m in self.members:
            log = m.log_path.open("ab")
            m.proc = subprocess.Popen(
                [
                    binary,
                    "--name", m.name,
                    "--data-dir", str(m.data_dir),
                    "--listen-client-urls", m.client_url,
                    "--advertise-client-urls", m.client_url,
                    "--listen-peer-urls", m.peer_url,
                    "--initial-advertise-peer-urls", m.peer_url,
                    "--initial-cluster", initial,
                    "--initial-cluster-state", "new",
                    "--initial-cluster-token", f"lumen-{os.getpid()}-{id(self)}",
                    *hygiene,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.close()
        self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float = 20.0) -> None:
        import asyncio

        from lumend.cluster.store import EtcdStore, StoreError

        async def probe() -> None:
            store = EtcdStore(self.endpoints, request_timeout_s=0.5, retry_budget_s=0.5)
            try:
                await store.put("/lumen-health-probe", b"ok")
            finally:
                await store.close()

        deadline = time.monotonic() + timeout_s
        while True:
            for m in self.members:
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(
                        f"etcd member {m.name} exited with {m.proc.returncode}; "
                        f"see {m.log_path}"
                    )
            try:
                asyncio.run(probe())
                return
            except StoreError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"etcd at {', '.join(self.endpoints)} not healthy after {timeout_s} s; "
                        f"see {self.workdir}/etcd*.log"
                    ) from None
                time.sleep(0.1)

    def stop(self) -> None:
        for m in self.members:
            m.stop()
        if self.data_root != self.workdir:
            shutil.rmtree(self.data_root, ignore_errors=True)


def data_root_for(workdir: Path) -> Path:
    """Where a local cluster's etcd keeps its data: in memory (/dev/shm) where there is one,
    else in `workdir`. A local cluster is thrown away when it stops, so etcd's fsyncs buy
    nothing there, and on a busy machine's disk they stalled etcd past a client's deadline
    (CI: "context deadline exceeded" on a 1 s read). Removed by `EtcdCluster.stop`; the
    logs stay in `workdir`."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"lumen-etcd-{os.getpid()}-{random.getrandbits(48):012x}"
    return workdir


@dataclass
class LumendNode:
    name: str
    config_path: Path
    log_path: Path
    gateway: str = ""  # the node's OpenAI API, http://host:port
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def metrics_url(self) -> str:
        """The node's Prometheus endpoint (gateway, holder and lumend metrics)."""
        listen = tomllib.loads(self.config_path.read_text())["metrics"]["listen"]
        return f"http://{listen}/metrics"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, python: str = sys.executable) -> LumendNode:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [python, "-m", "lumend", "run", "--config", str(self.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return self

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.running:
            self.signal(signal.SIGKILL)
            assert self.proc is not None
            self.proc.wait(timeout=5)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM and wait (SIGKILL after `grace_s`); returns the exit code."""
        if self.proc is None:
            return None
        stop_process(self.proc, grace_s)
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def cluster_keys(workdir: Path) -> Path:
    """The CURVE key file of the local cluster in `workdir`, created (0600) if absent."""
    path = workdir / "checkpoint.keys"
    if not path.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        CurveKeys.generate().write(path)
    return path


def node_config_toml(
    name: str,
    endpoints: Sequence[str],
    cluster: str,
    ports: Sequence[int],
    *,
    lease_ttl_s: int,
    workers: int = 1,
    shadows: int = 1,
    engine_args: Sequence[str] = (),
    workdir: Path,
    insecure: bool = False,
    api_keys: Path | None = None,
    draft_model: str | None = None,
    model: str = "sim-small",
    log_admissions: bool = False,
) -> str:
    """A node config on loopback; `ports` gives gateway, rpc, checkpoint, metrics, engines.
    Checkpoint sockets use CURVE with the cluster key file `workdir/checkpoint.keys`
    (generated by the first node that needs it), unless `insecure`. `api_keys`: the
    gateway's API key file (none: the gateway is open). `draft_model`: the workers' sim
    drafter, for draft-assist while they reload. `model`: the workers' sim model preset.
    `log_admissions`: the gateway logs each placement decision (`[gateway] log_admissions`)."""
    gateway, rpc, checkpoint, metrics, first_engine = ports[:5]
    endpoint_list = ", ".join(f'"{e}"' for e in endpoints)
    security = "insecure = true" if insecure else f'keys = "{cluster_keys(workdir)}"'
    text = f"""\
state_dir = "{workdir}/{name}/state"
runtime_dir = "{workdir}/{name}/run"

[node]
name = "{name}"
address = "127.0.0.1"

[etcd]
endpoints = [{endpoint_list}]
cluster = "{cluster}"
lease_ttl_s = {lease_ttl_s}
request_timeout_s = {min(2.0, lease_ttl_s / 3):.2f}

[gateway]
listen = "127.0.0.1:{gateway}"
{"" if api_keys is None else f'api_keys = "{api_keys}"'}
{"log_admissions = true" if log_admissions else ""}
[rpc]
listen = "127.0.0.1:{rpc}"
[checkpoint]
listen = "127.0.0.1:{checkpoint}"
budget_bytes = "1GiB"
{security}
[metrics]
listen = "127.0.0.1:{metrics}"
"""
    for i in range(workers):
        text += f"""
[[workers]]
name = "{name}-w{i}"
gpus = [{i}]
engine = "sim"
shadows = {shadows}
model = "{model}"
{"" if draft_model is None else f'draft_model = "{draft_model}"'}
args = [{", ".join(f'"{a}"' for a in engine_args)}]
port = {first_engine + (shadows + 1) * i}
"""
    return text


@dataclass
class LocalCluster:
    """etcd plus `size` lumend nodes, all on loopback under `workdir`."""

    workdir: Path
    size: int = 3
    etcd_members: int = 1
    cluster: str = "local"
    lease_ttl_s: int = 3
    workers_per_node: int = 1
    shadows: int = 1
    engine_args: tuple[str, ...] = ()
    node_shadows: dict[str, int] = field(default_factory=dict)  # by node name, else shadows
    api_keys: Path | None = None  # every gateway's API key file; None: open gateways
    node_draft_models: dict[str, str] = field(default_factory=dict)  # by node name
    model: str = "sim-small"  # every worker's sim model preset
    log_admissions: bool = False  # every gateway logs its placement decisions
    etcd: EtcdCluster = field(init=False)
    nodes: list[LumendNode] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.etcd = EtcdCluster(self.workdir, self.etcd_members)

    @property
    def endpoints(self) -> list[str]:
        return self.etcd.endpoints

    @property
    def keys_file(self) -> Path:
        """The cluster's CURVE key file (every node and engine uses it)."""
        return cluster_keys(self.workdir)

    def start(self) -> LocalCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.etcd.start()
        for i in range(self.size):
            self.add_node(f"node-{i + 1}")
        return self

    def add_node(self, name: str) -> LumendNode:
        shadows = self.node_shadows.get(name, self.shadows)
        # One run below the ephemeral range for all of them: the gateway, rpc, checkpoint
        # and metrics ports, then the engines'. A port the kernel handed out as free could
        # be taken by an outgoing connection before lumend bound it (a full test run here:
        # "checkpoint.listen ... Address already in use", a node that never started).
        first = free_port_run(4 + self.workers_per_node * (shadows + 1))
        ports = [first, first + 1, first + 2, first + 3, first + 4]
        config = self.workdir / f"{name}.toml"
        config.write_text(
            node_config_toml(
                name, self.endpoints, self.cluster, ports, lease_ttl_s=self.lease_ttl_s,
                workers=self.workers_per_node,
                shadows=self.node_shadows.get(name, self.shadows),
                engine_args=self.engine_args, workdir=self.workdir, api_keys=self.api_keys,
                draft_model=self.node_draft_models.get(name), model=self.model,
                log_admissions=self.log_admissions,
            )
        )
        node = LumendNode(name, config, self.workdir / f"{name}.log",
                          gateway=f"http://127.0.0.1:{ports[0]}").start()
        self.nodes.append(node)
        return node

    def node(self, name: str) -> LumendNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        self.etcd.stop()
