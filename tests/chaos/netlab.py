"""A network of namespaces for chaos scenarios: every etcd member and lumend node in a
network namespace of its own, all joined by a bridge in a hub namespace, and this (the
test's) namespace on the bridge too, to drive clients and read etcd.

Faults are made where a real network makes them, at the hosts' routing policy: a
`blackhole` rule drops on arrival every packet from an address, so a black hole between two
hosts (a rule on each) answers nothing, refuses nothing: connections hang until their
timeouts, as across a failed switch, not a closed port. A host's link set down cuts it off
from everything. This kernel has no `tc netem`: loss is made with nftables instead (a rule
on a host's input that drops a random share of what another host sends it, with a counter
that proves it dropped); delay is made by a userspace TCP relay (`DelayProxy`).

Everything is made by the lab and removed by `close()` (namespaces, links and the root
side's address); processes started in it are stopped by their own pid.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lumenctl.localcluster import etcd_binary, node_config_toml, stop_process

try:  # etcd's hygiene flags, as the local cluster sets them (when it does)
    from lumenctl.localcluster import ETCD_AUTO_COMPACTION_RETENTION, ETCD_QUOTA_BACKEND_BYTES
except ImportError:  # pragma: no cover - older local cluster
    ETCD_AUTO_COMPACTION_RETENTION, ETCD_QUOTA_BACKEND_BYTES = None, None


class LabUnavailable(Exception):
    """Network namespaces cannot be made here (not root, or no `ip`)."""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def nft_available() -> str | None:
    """Why packet loss cannot be made here (no nftables, or it does not work), or None."""
    if available() is not None:
        return available()
    if shutil.which("nft") is None:
        return "nftables' `nft` is not installed (apt-get install -y nftables): no packet loss"
    return None


def _nft(ns: str, script: str) -> str:
    done = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise LabUnavailable(f"nft in {ns} refused the loss rules: {done.stderr.strip()}")
    return done.stdout


def available() -> str | None:
    """Why the lab cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install -y iproute2)"
    return None


@dataclass
class Host:
    """One namespace on the lab's bridge."""

    lab: NetLab
    name: str
    ns: str
    ip: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # Loss on input: sender's address -> percent of its packets dropped.
    loss: dict[str, int] = field(default_factory=dict)
    dropped_before: int = 0  # drops counted by rules since replaced

    def popen(self, cmd: Sequence[str], log: Path,
              mounts: Tmpfs | None = None) -> subprocess.Popen[bytes]:
        """Start `cmd` in this namespace (`ip netns exec` execs it: the pid is the
        process's own); with `mounts`, in the mount namespace that tmpfs is mounted in
        (nsenter execs it)."""
        prefix = (["ip", "netns", "exec", self.ns] if mounts is None
                  else ["nsenter", "-t", str(mounts.holder_pid), "-m", "-n"])
        with log.open("ab") as out:
            proc = subprocess.Popen([*prefix, *cmd], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def drop_from(self, *ips: str) -> None:
        """Drop, on arrival, everything `ips` send this host (a policy rule on input): the
        senders hear nothing, as from a black hole; nothing is refused."""
        for ip in ips:
            _ip("rule", "add", "from", f"{ip}/32", "blackhole", "priority", "100", ns=self.ns)

    def undrop_from(self, *ips: str) -> None:
        for ip in ips:
            _ip("rule", "del", "from", f"{ip}/32", "blackhole", "priority", "100", ns=self.ns)

    def lose_from(self, percent: int, *ips: str) -> None:
        """Drop, on arrival, `percent` % of the packets `ips` send this host, at random and
        independently (nftables' `numgen random`), each drop counted; 0 removes the rule.
        Raises LabUnavailable when nftables cannot do it here."""
        why = nft_available()
        if why is not None:
            raise LabUnavailable(why)
        self.dropped_before = self.dropped()
        for ip in ips:
            if percent > 0:
                self.loss[ip] = percent
            else:
                self.loss.pop(ip, None)
        rules = "".join(f"        ip saddr {ip} numgen random mod 100 < {p} counter drop\n"
                        for ip, p in sorted(self.loss.items()))
        # One transaction: the table is made if missing, emptied and filled again.
        _nft(self.ns, "table inet lab {}\ndelete table inet lab\n"
                      "table inet lab {\n    chain input {\n"
                      "        type filter hook input priority 0; policy accept;\n"
                      f"{rules}    }}\n}}\n")

    def dropped(self) -> int:
        """Packets the loss rules dropped on this host, all senders, since the lab began."""
        if shutil.which("nft") is None:
            return self.dropped_before
        done = subprocess.run(["ip", "netns", "exec", self.ns, "nft", "-j", "list", "table",
                               "inet", "lab"], capture_output=True, text=True)
        if done.returncode != 0:  # no table (yet)
            return self.dropped_before
        total = 0
        for item in json.loads(done.stdout).get("nftables", []):
            for expr in item.get("rule", {}).get("expr", []):
                if isinstance(expr, dict) and "counter" in expr:
                    total += int(expr["counter"]["packets"])
        return self.dropped_before + total

    def relay_inbound(self, ports: Sequence[int], offset: int = 10000) -> list[DelayProxy]:
        """Every TCP connection another host opens to one of `ports` here goes through a
        `DelayProxy` on this host: an nftables DNAT on arrival sends it to the relay (on
        port + `offset`), which connects to the port locally, so its own connection is not
        redirected. What other hosts send to those ports and what this host answers them
        is delayed, each way; connections this host opens, or opens to itself, are not.
        No delay until one is set. nat sees new connections only: make the relays before
        the connections. Raises LabUnavailable when nftables cannot do it here."""
        why = nft_available()
        if why is not None:
            raise LabUnavailable(why)
        relays = [DelayProxy(self, f"{self.ip}:{port + offset}", f"{self.ip}:{port}",
                             self.lab.workdir / f"{self.name}.in{port}").start()
                  for port in ports]
        rules = "".join(f"        ip saddr != {self.ip} tcp dport {port} "
                        f"dnat to {self.ip}:{port + offset}\n" for port in ports)
        _nft(self.ns, "table ip labnat {\n    chain prerouting {\n"
                      "        type nat hook prerouting priority -100; policy accept;\n"
                      f"{rules}    }}\n}}\n")
        wait_listening(relays)
        return relays

    def cut(self) -> None:
        """Take this host off the network (its link down)."""
        _ip("link", "set", "eth0", "down", ns=self.ns)

    def mend(self) -> None:
        _ip("link", "set", "eth0", "up", ns=self.ns)


class NetLab:
    """Namespaces on one bridge, named after this process so parallel runs do not meet."""

    def __init__(self, workdir: Path) -> None:
        why = available()
        if why is not None:
            raise LabUnavailable(why)
        self.workdir = workdir
        tag = os.getpid() % 100000
        self.prefix = f"lc{tag}"
        self.net = f"10.{200 + tag % 50}.{tag % 250}"
        self.hub = f"{self.prefix}h"
        self.hosts: list[Host] = []
        self.root_ip = f"{self.net}.254"
        self._root_link = f"{self.prefix}r"
        try:
            subprocess.run(["ip", "netns", "add", self.hub], check=True, capture_output=True)
            _ip("link", "add", "br0", "type", "bridge", ns=self.hub)
            _ip("link", "set", "br0", "up", ns=self.hub)
            _ip("link", "set", "lo", "up", ns=self.hub)
            _ip("link", "add", self._root_link, "type", "veth", "peer", "name", "hubroot")
            _ip("link", "set", "hubroot", "netns", self.hub)
            _ip("link", "set", "hubroot", "master", "br0", ns=self.hub)
            _ip("link", "set", "hubroot", "up", ns=self.hub)
            _ip("addr", "add", f"{self.root_ip}/24", "dev", self._root_link)
            _ip("link", "set", self._root_link, "up")
        except (RuntimeError, subprocess.CalledProcessError):
            self.close()
            raise

    def host(self, name: str) -> Host:
        k = len(self.hosts) + 1
        ns = f"{self.prefix}n{k}"
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        outside, inside = f"{self.prefix}a{k}", f"{self.prefix}b{k}"
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", outside, "netns", self.hub)
        _ip("link", "set", outside, "master", "br0", ns=self.hub)
        _ip("link", "set", outside, "up", ns=self.hub)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", inside, "name", "eth0", ns=ns)
        _ip("addr", "add", f"{self.net}.{k}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        # The local table's rule comes first (priority 0) and would accept every packet for
        # this host before a black-hole rule is read: it moves behind them.
        _ip("rule", "add", "from", "all", "lookup", "local", "priority", "1000", ns=ns)
        _ip("rule", "del", "priority", "0", ns=ns)
        host = Host(self, name, ns, f"{self.net}.{k}")
        self.hosts.append(host)
        return host

    def black_hole(self, a: Host, b: Host) -> None:
        """Packets between `a` and `b` vanish in both directions (each drops what the other
        sends on arrival): connections between them hang, new ones time out."""
        a.drop_from(b.ip)
        b.drop_from(a.ip)

    def heal(self, a: Host, b: Host) -> None:
        a.undrop_from(b.ip)
        b.undrop_from(a.ip)

    def lossy(self, a: Host, b: Host, percent: int) -> None:
        """`percent` % of the packets between `a` and `b` vanish, each direction on its own
        (each host drops that share of what the other sends); 0 makes the link clean."""
        a.lose_from(percent, b.ip)
        b.lose_from(percent, a.ip)

    def close(self) -> None:
        # Last made, first stopped: lumend nodes before the etcd they deregister from (with
        # etcd gone first each node's stop waited out its etcd retries, then SIGKILL).
        for host in reversed(self.hosts):
            for proc in reversed(host.procs):
                stop_process(proc, 5.0)
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self._root_link], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.hub], capture_output=True)
        self.hosts.clear()


@dataclass
class Tmpfs:
    """A tmpfs of `mib` MiB at `path`, mounted in the mount namespace of a holder process
    on `host` (`ip netns exec` gives it one of its own): processes started in it (through
    `Host.popen(..., mounts=)`) see it, nothing else does, and it is gone with the holder,
    which outlives them (they can be restarted on the same files, as systemd would). A disk
    that can be filled."""

    host: Host
    path: Path
    mib: int
    holder: subprocess.Popen[bytes] | None = None

    def mount(self) -> Tmpfs:
        self.path.mkdir(parents=True, exist_ok=True)
        self.holder = self.host.popen(
            ["sh", "-c", f'mount -t tmpfs -o size={self.mib}m lab "$0" && exec sleep infinity',
             str(self.path)], self.host.lab.workdir / f"{self.host.name}.mount.log")
        deadline = time.monotonic() + 10
        while self.run("stat", "-f", "-c", "%T", str(self.path)).stdout.strip() != "tmpfs":
            if self.holder.poll() is not None or time.monotonic() > deadline:
                raise LabUnavailable(f"no tmpfs at {self.path}: see {self.host.name}.mount.log")
            time.sleep(0.05)
        return self

    @property
    def holder_pid(self) -> int:
        assert self.holder is not None, "mount() first"
        return self.holder.pid

    @property
    def filler(self) -> Path:
        return self.path / "filler"  # on the tmpfs, beside what its users write

    def run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        """`cmd` in the mount namespace the tmpfs is mounted in."""
        return subprocess.run(["nsenter", "-t", str(self.holder_pid), "-m", *cmd],
                              capture_output=True, text=True)

    def free(self) -> int:
        """Bytes free on the tmpfs."""
        done = self.run("stat", "-f", "-c", "%a %S", str(self.path))
        if done.returncode != 0:
            raise RuntimeError(f"stat in the tmpfs's mounts: {done.stderr.strip()}")
        blocks, size = done.stdout.split()
        return int(blocks) * int(size)

    def fill(self, leave_bytes: int = 0) -> None:
        """Take the free space but `leave_bytes` (a file beside what is there)."""
        size = max(0, self.free() - leave_bytes)
        done = self.run("fallocate", "-l", str(size), str(self.filler))
        if done.returncode != 0:
            raise RuntimeError(f"fallocate in the tmpfs's mounts: {done.stderr.strip()}")

    def unfill(self) -> None:
        self.run("rm", "-f", str(self.filler))


@dataclass
class EtcdMember:
    host: Host
    name: str
    proc: subprocess.Popen[bytes] | None = None
    data_dir: Path | None = None
    tmpfs_mib: int | None = None  # the data dir is a tmpfs of this size, etcd's alone
    argv: list[str] = field(default_factory=list)
    tmpfs: Tmpfs | None = None  # mounted at the first start, kept across restarts
    peer_relays: list[DelayProxy] = field(default_factory=list)  # its inbound peer links

    def start(self) -> None:
        """Start (or restart) etcd on its data dir."""
        assert self.data_dir is not None
        log = self.host.lab.workdir / f"{self.name}.log"
        if self.tmpfs_mib is not None and self.tmpfs is None:
            self.tmpfs = Tmpfs(self.host, self.data_dir, self.tmpfs_mib).mount()
        self.proc = self.host.popen(self.argv, log, mounts=self.tmpfs)

    def disk(self) -> Tmpfs:
        assert self.tmpfs is not None, "the member has no tmpfs"
        return self.tmpfs

    @property
    def client_url(self) -> str:
        return f"http://{self.host.ip}:2379"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host.ip}:2380"


def start_etcd(lab: NetLab, size: int, tmpfs_mib: int | None = None,
               relay_peers: bool = False) -> list[EtcdMember]:
    """`size` etcd members, each on a host of its own; returns once the cluster answers.
    With `tmpfs_mib` each member's data dir is a tmpfs of that size mounted in the member's
    own mount namespace (gone with the process): a disk that can be filled. With
    `relay_peers` what every member receives on its peer port goes through a `DelayProxy`
    on its host (`Host.relay_inbound`; no delay until one is set): a message between two
    members crosses one relay, a round trip two. Client traffic is not relayed."""
    members = [EtcdMember(lab.host(f"etcd{i}"), f"etcd{i}", data_dir=lab.workdir / f"etcd{i}.data",
                          tmpfs_mib=tmpfs_mib) for i in range(size)]
    if relay_peers:
        for m in members:
            m.peer_relays = m.host.relay_inbound([2380])
    initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
    hygiene: list[str] = []
    if ETCD_AUTO_COMPACTION_RETENTION is not None:
        hygiene += ["--auto-compaction-mode", "periodic",
                    "--auto-compaction-retention", str(ETCD_AUTO_COMPACTION_RETENTION)]
    if ETCD_QUOTA_BACKEND_BYTES is not None:
        hygiene += ["--quota-backend-bytes", str(ETCD_QUOTA_BACKEND_BYTES)]
    for m in members:
        m.argv = [
            etcd_binary(), "--name", m.name, "--data-dir", str(m.data_dir),
            "--listen-client-urls", m.client_url, "--advertise-client-urls", m.client_url,
            "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", initial, "--initial-cluster-state", "new",
            "--initial-cluster-token", lab.prefix, *hygiene,
        ]
        m.start()
    deadline = time.monotonic() + 30
    while True:
        done = subprocess.run(["etcdctl", "--endpoints", ",".join(m.client_url for m in members),
                               "endpoint", "health"], capture_output=True, text=True,
                              env={**os.environ, "ETCDCTL_API": "3"})
        if done.returncode == 0:
            return members
        if time.monotonic() > deadline:
            raise RuntimeError(f"etcd in the lab not healthy: {done.stderr.strip()}")
        time.sleep(0.2)


DELAY_PROXY = Path(__file__).with_name("delayproxy.py")


def wait_listening(relays: Sequence[DelayProxy], timeout_s: float = 10.0) -> None:
    """Until every relay has reported once (it reports once it listens)."""
    deadline = time.monotonic() + timeout_s
    for relay in relays:
        stats = relay.control.with_name(relay.control.name + ".stats")
        while not stats.exists():
            if (relay.proc is not None and relay.proc.poll() is not None) \
                    or time.monotonic() > deadline:
                raise LabUnavailable(f"the delay relay on {relay.listen} did not start: see "
                                     f"{relay.control.with_suffix('.log')}")
            time.sleep(0.05)


@dataclass
class DelayProxy:
    """A TCP relay on `host` from `listen` to `target` (ip:port each) that delays what it
    carries by the one-way delay it is set to (`delayproxy.py`): where a client's path to a
    server goes through it, their round trip is 2 x that longer."""

    host: Host
    listen: str
    target: str
    control: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DelayProxy:
        self.control.write_text("0")
        self.proc = self.host.popen([sys.executable, str(DELAY_PROXY), self.listen,
                                     self.target, str(self.control)],
                                    self.control.with_suffix(".log"))
        return self

    def delay(self, one_way_ms: float) -> None:
        """Delay each chunk, each way, by `one_way_ms` (0: relay at once)."""
        partial = self.control.with_name(self.control.name + ".partial")
        partial.write_text(str(one_way_ms))
        partial.replace(self.control)

    def stats(self) -> dict[str, int]:
        """What the relay counted: connections, chunks, chunks_delayed (zeros until its
        first report)."""
        try:
            found = json.loads(self.control.with_name(self.control.name + ".stats").read_text())
        except (OSError, ValueError):
            found = {}
        return {k: int(found.get(k, 0)) for k in ("connections", "chunks", "chunks_delayed")}

    @property
    def url(self) -> str:
        return f"http://{self.listen}"


@dataclass
class Node:
    """A lumend process on a host of its own."""

    host: Host
    name: str
    config_path: Path
    log_path: Path
    gateway: str
    rpc: str
    proc: subprocess.Popen[bytes] | None = None
    state: Tmpfs | None = None  # its state dir, when that is a tmpfs
    etcd_relays: list[DelayProxy] = field(default_factory=list)  # its paths to etcd, if relayed
    peer_relays: list[DelayProxy] = field(default_factory=list)  # what its peers send it

    def start(self) -> Node:
        self.proc = self.host.popen([sys.executable, "-m", "lumend", "run", "--config",
                                     str(self.config_path)], self.log_path, mounts=self.state)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


GATEWAY, RPC, CHECKPOINT, METRICS, ENGINES = 8100, 8200, 8300, 8400, 8500


def start_node(lab: NetLab, name: str, endpoints: Sequence[str], cluster: str, *,
               lease_ttl_s: int = 3, shadows: int = 0, engine_args: Sequence[str] = (),
               gateway_settings: str = "", state_tmpfs_mib: int | None = None,
               relay_etcd: bool = False, relay_peers: bool = False) -> Node:
    """A lumend node with one sim worker on a host of its own (the local cluster's config,
    on the host's address); `gateway_settings`: extra `[gateway]` lines; `state_tmpfs_mib`:
    its state dir (engine logs) is a tmpfs of that size, lumend's alone; `relay_etcd`: the
    node reaches each etcd endpoint through a `DelayProxy` on its own host (no delay until
    one is set); `relay_peers`: what other hosts send to its RPC, checkpoint and engine
    ports (Admit and Recover, checkpoint streams to its holder, gateways' streams from its
    engine) goes through a `DelayProxy` each on its host (`Host.relay_inbound`)."""
    host = lab.host(name)
    peer_relays = host.relay_inbound([RPC, CHECKPOINT, ENGINES]) if relay_peers else []
    relays: list[DelayProxy] = []
    if relay_etcd:
        for i, endpoint in enumerate(endpoints):
            relays.append(DelayProxy(host, f"{host.ip}:{12379 + i}",
                                     endpoint.split("//", 1)[-1],
                                     lab.workdir / f"{name}.relay{i}").start())
        endpoints = [r.url for r in relays]
    text = node_config_toml(name, endpoints, cluster,
                            [GATEWAY, RPC, CHECKPOINT, METRICS, ENGINES],
                            lease_ttl_s=lease_ttl_s, shadows=shadows,
                            engine_args=engine_args, workdir=lab.workdir)
    text = text.replace("127.0.0.1", host.ip).replace("[gateway]\n",
                                                      f"[gateway]\n{gateway_settings}\n", 1)
    config = lab.workdir / f"{name}.toml"
    config.write_text(text)
    node = Node(host, name, config, lab.workdir / f"{name}.log",
                f"http://{host.ip}:{GATEWAY}", f"{host.ip}:{RPC}", etcd_relays=relays,
                peer_relays=peer_relays)
    if state_tmpfs_mib is not None:
        node.state = Tmpfs(host, lab.workdir / name / "state", state_tmpfs_mib).mount()
    return node.start()
