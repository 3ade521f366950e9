"""Chaos scenarios on a namespace lab (`netlab.py`): real etcd and lumend processes, each on
a network namespace of its own, under streaming load through a gateway; each returns a row
of the fault matrix (what the clients got, how long admissions stopped, etcd's size after).
The tests assert on the rows; `bench/chaos.py` prints them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from lumenctl.demo import read_view
from lumend.cluster.view import ClusterView
from lumend.rpc.client import CoordinatorClient, RpcFailure

from ..gateway.test_gateway import chat_prompt, expected, stream
from .netlab import METRICS, EtcdMember, NetLab, Node, start_etcd, start_node

ENGINE_ARGS = ("--time-scale", "2.0")
# A black-holed engine sends nothing: the gap after which the gateway resumes elsewhere.
GATEWAY_SETTINGS = "token_timeout_s = 3\nresume_within_s = 60"
STREAMS = 8


@dataclass
class Row:
    """One line of the fault matrix."""

    scenario: str
    streams: int = 0
    completed: int = 0  # ended with a finish, no error
    identical: int = 0  # equal, token for token, to the failure-free stream
    lost: int = 0  # an error, or ended short
    duplicated: int = 0  # longer than the failure-free stream (text sent twice)
    admissions_resumed_s: float | None = None  # from the fault to the next Admit answered
    etcd_db_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    def cells(self) -> list[str]:
        resumed = ("-" if self.admissions_resumed_s is None
                   else f"{self.admissions_resumed_s:.1f} s")
        db = "-" if self.etcd_db_bytes is None else f"{self.etcd_db_bytes / 2**20:.1f} MiB"
        return [self.scenario, str(self.streams), str(self.completed), str(self.identical),
                str(self.lost), str(self.duplicated), resumed, db, "; ".join(self.notes)]


HEADER = ["scenario", "streams", "completed", "token-identical", "lost", "duplicated",
          "admissions resumed after", "etcd db after", "notes"]


class Cluster:
    """etcd members and lumend nodes on a lab."""

    def __init__(self, lab: NetLab, etcd_members: int, nodes: int) -> None:
        self.lab = lab
        self.name = "chaos"
        self.etcd: list[EtcdMember] = start_etcd(lab, etcd_members)
        self.endpoints = [m.client_url for m in self.etcd]
        self.nodes: list[Node] = [
            start_node(lab, f"node-{i + 1}", self.endpoints, self.name,
                       engine_args=ENGINE_ARGS, gateway_settings=GATEWAY_SETTINGS)
            for i in range(nodes)]

    def view(self, endpoints: list[str] | None = None) -> ClusterView:
        return read_view(endpoints or self.endpoints, self.name)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def wait(self, probe: Callable[[ClusterView], bool], timeout_s: float, what: str,
             endpoints: list[str] | None = None) -> ClusterView:
        deadline = time.monotonic() + timeout_s
        last: ClusterView | None = None
        while time.monotonic() < deadline:
            try:
                last = self.view(endpoints)
                if probe(last):
                    return last
            except Exception:  # etcd itself may be what the fault took away
                pass
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last view: "
                             f"{None if last is None else summary(last)}")

    def settled(self, view: ClusterView) -> bool:
        """Every node registered, every worker serving, one coordinator they all follow."""
        if view.coordinator is None or len(view.nodes) != len(self.nodes):
            return False
        leader, epoch = view.coordinator.record.node, view.coordinator.epoch
        for node in view.nodes.values():
            want = ("coordinating as" if node.name == leader else "following coordinator")
            if not node.status.startswith(f"{want} {leader} (epoch {epoch})"):
                return False
        return len(view.workers) == len(self.nodes) and all(
            w.state == "serving" and w.checkpoints.budget_bytes > 0
            for w in view.workers.values())

    def db_bytes(self) -> int | None:
        done = subprocess.run(["etcdctl", "--endpoints", ",".join(self.endpoints), "endpoint",
                               "status", "-w", "json"], capture_output=True, text=True,
                              env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})
        if done.returncode != 0:
            return None
        try:
            return max(int(s["Status"]["dbSize"]) for s in json.loads(done.stdout))
        except (ValueError, KeyError, TypeError):
            return None


def summary(view: ClusterView) -> str:
    coordinator = (None if view.coordinator is None else
                   f"{view.coordinator.record.node}@{view.coordinator.epoch}")
    return (f"coordinator {coordinator}, nodes "
            f"{ {n: r.status[:40] for n, r in view.nodes.items()} }, workers "
            f"{ {w: r.state for w, r in view.workers.items()} }")


class Load:
    """STREAMS streams through one gateway (even: completions, odd: chat), long enough to
    span the fault; classified against the failure-free stream when they end."""

    def __init__(self, gateway: str) -> None:
        self.gateway = gateway
        self.prompts = [f"chaos stream {i} keeps talking" for i in range(STREAMS)]
        self.received = [[0] for _ in self.prompts]
        self.tasks: list[asyncio.Task[tuple[set[str], str, list[str]]]] = []

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.tasks = [asyncio.create_task(stream(session, self.gateway, i % 2 == 1, p,
                                                 self.received[i]))
                      for i, p in enumerate(self.prompts)]
        deadline = time.monotonic() + 60
        while min(r[0] for r in self.received) < 5:
            if time.monotonic() > deadline:
                raise AssertionError(f"the streams never got going: {self.received}")
            await asyncio.sleep(0.02)

    async def finish(self, row: Row) -> None:
        results = await asyncio.gather(*self.tasks, return_exceptions=True)
        row.streams = len(results)
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                row.lost += 1
                row.notes.append(f"stream {i}: {type(result).__name__}: {result}")
                continue
            ids, text, errors = result
            prompt = self.prompts[i]
            reference = expected(chat_prompt(prompt) if i % 2 == 1 else prompt)
            if errors or len(ids) != 1:
                row.lost += 1
                row.notes.append(f"stream {i}: {errors or ids}")
            elif text == reference:
                row.completed += 1
                row.identical += 1
            elif len(text) > len(reference):
                row.completed += 1
                row.duplicated += 1
            elif reference.startswith(text):
                row.lost += 1
            else:
                row.completed += 1
                row.notes.append(f"stream {i} differs from the failure-free one")


def streams_in_flight(node: Node) -> dict[str, float]:
    """The node's gateway streams per worker (`lumen_gateway_streams_in_flight`)."""
    url = f"http://{node.host.ip}:{METRICS}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        lines = r.read().decode().splitlines()
    found: dict[str, float] = {}
    for line in lines:
        if line.startswith('lumen_gateway_streams_in_flight{worker="'):
            worker = line.split('"')[1]
            found[worker] = float(line.split()[-1])
    return found


async def admit_works(cluster: Cluster, endpoints: list[str] | None = None) -> bool:
    """Whether the coordinator in etcd answers an Admit now."""
    try:
        view = await asyncio.to_thread(cluster.view, endpoints)
    except Exception:
        return False
    if view.coordinator is None:
        return False
    client = CoordinatorClient(view.coordinator.record.rpc)
    try:
        admission = await client.admit(f"probe-{time.monotonic_ns()}", None, "chaos")
        return admission.target is not None
    except RpcFailure:
        return False
    finally:
        await client.close()


async def until_admissions_resume(cluster: Cluster, since: float, timeout_s: float,
                                  endpoints: list[str] | None = None) -> float:
    deadline = time.monotonic() + timeout_s
    while not await admit_works(cluster, endpoints):
        if time.monotonic() > deadline:
            raise AssertionError(f"no coordinator answered Admit within {timeout_s} s")
        await asyncio.sleep(0.1)
    return time.monotonic() - since


async def old_coordinator_refuses(node: Node) -> bool:
    client = CoordinatorClient(node.rpc)
    try:
        await client.admit(f"stale-{time.monotonic_ns()}", None, "chaos")
        return False
    except RpcFailure as exc:
        return exc.code == "UNAVAILABLE"
    finally:
        await client.close()


# -- scenarios ----------------------------------------------------------------------------


@contextmanager
def lab_cluster(workdir: Path, etcd_members: int) -> Iterator[tuple[NetLab, Cluster]]:
    """A lab with `etcd_members` etcd members and 3 lumend nodes, removed afterwards."""
    lab = NetLab(workdir)
    try:
        yield lab, Cluster(lab, etcd_members=etcd_members, nodes=3)
    finally:
        lab.close()


def coordinator_cut_off_from_etcd(workdir: Path, hold_s: float = 30.0) -> Row:
    """The coordinator's node loses etcd (a black hole, its peers still reachable). Its term
    must end (it stops answering Admit) and another node must be elected; streams through
    another node's gateway go on. Then, after at least `hold_s` (an outage long enough for
    connection backoff to grow: a node once froze for good after one of 60-90 s), the network
    heals and it must rejoin as a follower."""
    row = Row("coordinator's node black-holed from etcd")
    with lab_cluster(workdir, etcd_members=1) as (lab, cluster):
        view = cluster.wait(cluster.settled, 90, "3 nodes settled")
        assert view.coordinator is not None
        old, epoch = cluster.node(view.coordinator.record.node), view.coordinator.epoch
        via = next(n for n in cluster.nodes if n is not old)

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                load = Load(via.gateway)
                await load.start(session)
                fault = time.monotonic()
                for member in cluster.etcd:
                    lab.black_hole(old.host, member.host)
                new = await asyncio.to_thread(
                    cluster.wait, lambda v: v.coordinator is not None
                    and v.coordinator.epoch > epoch, 60, "a new coordinator")
                assert new.coordinator is not None
                row.notes.append(f"new coordinator {new.coordinator.record.node} after "
                                 f"{time.monotonic() - fault:.1f} s")
                row.admissions_resumed_s = await until_admissions_resume(cluster, fault, 30)
                if not await old_coordinator_refuses(old):
                    row.notes.append("THE OLD COORDINATOR STILL ANSWERS ADMIT")
                await load.finish(row)
                await asyncio.sleep(max(0.0, hold_s - (time.monotonic() - fault)))
                for member in cluster.etcd:
                    lab.heal(old.host, member.host)
                healed = time.monotonic()
                await asyncio.to_thread(cluster.wait, cluster.settled, 60,
                                        "the old coordinator back as a follower")
                row.notes.append(f"old coordinator back {time.monotonic() - healed:.1f} s "
                                 "after the heal")

        asyncio.run(run())
        row.etcd_db_bytes = cluster.db_bytes()
        return row


def etcd_member_black_holed(workdir: Path) -> Row:
    """One of three etcd members becomes a black hole for every lumend node (the leader's
    or not: whichever the nodes talk to first). Clients must move to the other two members
    and the cluster go on, streams uninterrupted."""
    row = Row("one of 3 etcd members black-holed")
    with lab_cluster(workdir, etcd_members=3) as (lab, cluster):
        cluster.wait(cluster.settled, 90, "3 nodes settled")
        lost = cluster.etcd[0]
        rest = [m.client_url for m in cluster.etcd[1:]]

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                load = Load(cluster.nodes[0].gateway)
                await load.start(session)
                fault = time.monotonic()
                for node in cluster.nodes:
                    lab.black_hole(node.host, lost.host)
                row.admissions_resumed_s = await until_admissions_resume(cluster, fault, 60,
                                                                         rest)
                await load.finish(row)
                before = time.monotonic()
                await asyncio.to_thread(cluster.wait, lambda v: all(
                    time.time() - r.updated_at < 10 for r in v.nodes.values()), 30,
                    "every node heartbeating through the other members", rest)
                row.notes.append(f"heartbeats current {time.monotonic() - before:.1f} s "
                                 "after the streams ended")

        asyncio.run(run())
        row.etcd_db_bytes = cluster.db_bytes()
        return row


def node_cut_off_from_its_peers(workdir: Path) -> Row:
    """A node keeps etcd but loses its peers (a black hole between it and every other
    node): streams another node's gateway runs on its engine hang and must resume elsewhere
    after the token timeout, from their checkpoints on the other nodes' holders."""
    row = Row("a node black-holed from its peers (not from etcd)")
    with lab_cluster(workdir, etcd_members=1) as (lab, cluster):
        cluster.wait(cluster.settled, 90, "3 nodes settled")
        via = cluster.nodes[0]

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                load = Load(via.gateway)
                await load.start(session)
                running = await asyncio.to_thread(streams_in_flight, via)
                others = {w: n for w, n in running.items() if not w.startswith(via.name + "-")}
                if not any(others.values()):
                    row.notes.append(f"VOID: every stream ran on {via.name}: {running}")
                    await load.finish(row)
                    return
                worker = max(others, key=lambda w: others[w])
                victim = cluster.node(worker.rsplit("-w", 1)[0])
                row.notes.append(f"{victim.name} cut off with {others[worker]:.0f} streams")
                fault = time.monotonic()
                for node in cluster.nodes:
                    if node is not victim:
                        lab.black_hole(victim.host, node.host)
                row.admissions_resumed_s = await until_admissions_resume(cluster, fault, 30)
                await load.finish(row)
                resumed = via.log_text().count("resuming request")
                row.notes.append(f"{resumed} streams resumed elsewhere")

        asyncio.run(run())
        row.etcd_db_bytes = cluster.db_bytes()
        return row


def etcd_quorum_lost_and_back(workdir: Path) -> Row:
    """Two of three etcd members vanish (black holes to everyone): no quorum, no lease, no
    coordinator. Streams in flight go on (engines and gateways need no etcd; gateways decide
    locally); when the members come back a coordinator is elected and admissions resume."""
    row = Row("etcd quorum lost (2 of 3 members black-holed), then back")
    with lab_cluster(workdir, etcd_members=3) as (lab, cluster):
        view = cluster.wait(cluster.settled, 90, "3 nodes settled")
        assert view.coordinator is not None
        epoch = view.coordinator.epoch
        gone = cluster.etcd[1:]
        everyone = [m.host for m in cluster.etcd[:1]] + [n.host for n in cluster.nodes]

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                load = Load(cluster.nodes[0].gateway)
                await load.start(session)
                for member in gone:
                    for host in everyone:
                        lab.black_hole(member.host, host)
                await asyncio.sleep(8)  # past the lease TTL: every term has ended
                healed = time.monotonic()
                for member in gone:
                    for host in everyone:
                        lab.heal(member.host, host)
                row.admissions_resumed_s = await until_admissions_resume(cluster, healed, 60)
                row.notes.append("admissions measured from the heal")
                await load.finish(row)
                after = await asyncio.to_thread(cluster.wait, cluster.settled, 60,
                                                "settled again")
                assert after.coordinator is not None
                row.notes.append(f"epoch {epoch} -> {after.coordinator.epoch}")

        asyncio.run(run())
        row.etcd_db_bytes = cluster.db_bytes()
        return row


def two_nodes_lost_at_once(workdir: Path) -> Row:
    """Two of three nodes drop off the network together (links down): two workers at once,
    and with them the holders of each other's checkpoints. Streams through the third node's
    gateway that ran there continue on it, recomputing what their lost checkpoints held."""
    row = Row("two of 3 nodes lost at once (servers and their holders)")
    with lab_cluster(workdir, etcd_members=1) as (_lab, cluster):
        cluster.wait(cluster.settled, 90, "3 nodes settled")
        via = cluster.nodes[0]

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                load = Load(via.gateway)
                await load.start(session)
                running = await asyncio.to_thread(streams_in_flight, via)
                away = sum(n for w, n in running.items() if not w.startswith(via.name + "-"))
                row.notes.append(f"{away:.0f} streams on the lost nodes")
                fault = time.monotonic()
                for node in cluster.nodes[1:]:
                    node.host.cut()
                row.admissions_resumed_s = await until_admissions_resume(cluster, fault, 60)
                await load.finish(row)

        asyncio.run(run())
        row.etcd_db_bytes = cluster.db_bytes()
        return row


SCENARIOS: dict[str, Callable[[Path], Row]] = {
    "two-nodes-lost": two_nodes_lost_at_once,
    "coordinator-etcd-partition": coordinator_cut_off_from_etcd,
    "etcd-member-blackhole": etcd_member_black_holed,
    "node-peer-partition": node_cut_off_from_its_peers,
    "etcd-quorum-loss": etcd_quorum_lost_and_back,
}
