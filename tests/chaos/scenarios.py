"""Chaos scenarios on a namespace lab (`netlab.py`): real etcd and lumend processes, each on
a network namespace of its own, under streaming load through a gateway; each returns a row
of the fault matrix (what the clients got, how long admissions stopped, etcd's size after).
The tests assert on the rows; `bench/chaos.py` prints them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
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
from ..integration.test_coordinator import caught_up
from .netlab import METRICS, EtcdMember, NetLab, Node, Tmpfs, start_etcd, start_node

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

    def __init__(self, lab: NetLab, etcd_members: int, nodes: int,
                 etcd_tmpfs_mib: int | None = None,
                 state_tmpfs_mib: dict[str, int] | None = None,
                 relay_etcd: bool = False, relay_etcd_peers: bool = False,
                 relay_node_peers: bool = False) -> None:
        self.lab = lab
        self.name = "chaos"
        self.etcd: list[EtcdMember] = start_etcd(lab, etcd_members, tmpfs_mib=etcd_tmpfs_mib,
                                                 relay_peers=relay_etcd_peers)
        self.endpoints = [m.client_url for m in self.etcd]
        self.nodes: list[Node] = [
            start_node(lab, f"node-{i + 1}", self.endpoints, self.name,
                       engine_args=ENGINE_ARGS, gateway_settings=GATEWAY_SETTINGS,
                       state_tmpfs_mib=(state_tmpfs_mib or {}).get(f"node-{i + 1}"),
                       relay_etcd=relay_etcd, relay_peers=relay_node_peers)
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

    def ready(self, timeout_s: float, what: str) -> ClusterView:
        """Settled, and the coordinator's own view caught up with it."""
        deadline = time.monotonic() + timeout_s
        view = self.wait(self.settled, timeout_s, what)
        asyncio.run(coordinator_caught_up(view, max(10.0, deadline - time.monotonic())))
        return view

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


async def coordinator_caught_up(view: ClusterView, timeout_s: float) -> None:
    """`caught_up` with checkpoints, against the coordinator `view` names. Without it a burst
    started at once went, every request of it, to the one worker the coordinator had seen
    serving, without checkpoints ("no holder has budget"), and the scenarios that need
    streams on other nodes were void."""
    assert view.coordinator is not None
    client = CoordinatorClient(view.coordinator.record.rpc)
    try:
        await caught_up(client, len(view.workers), timeout_s, with_checkpoint=True)
    finally:
        await client.close()


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


def metric(node: Node, name: str, *labels: str) -> float | None:
    """The node's samples of `name` whose labels include `labels` (`kind="x"`), summed; None
    if absent or unreachable."""
    try:
        with urllib.request.urlopen(f"http://{node.host.ip}:{METRICS}/metrics", timeout=5) as r:
            lines = r.read().decode().splitlines()
    except OSError:
        return None
    found = [float(line.split()[-1]) for line in lines
             if (not labels and line.startswith(name + " "))
             or (line.startswith(name + "{")
                 and all(label in line.split("}")[0] for label in labels))]
    return sum(found) if found else None


async def admit_works(cluster: Cluster, endpoints: list[str] | None = None) -> bool:
    """Whether the coordinator in etcd answers an Admit now."""
    return await admit_refused(cluster, endpoints) is None


async def admit_refused(cluster: Cluster, endpoints: list[str] | None = None) -> str | None:
    """Why the coordinator in etcd does not answer an Admit now (None: it does)."""
    try:
        view = await asyncio.to_thread(cluster.view, endpoints)
    except Exception:
        return "etcd unreadable"
    if view.coordinator is None:
        return "no coordinator in etcd"
    client = CoordinatorClient(view.coordinator.record.rpc)
    probe = f"probe-{time.monotonic_ns()}"
    try:
        admission = await client.admit(probe, None, "chaos")
    except RpcFailure as exc:
        await client.close()
        if "not sure of its lease" in exc.details:
            return f"{exc.code} (lease not sure)"
        if "not the coordinator" in exc.details:
            return f"{exc.code} (not the coordinator)"
        return exc.code
    try:  # a probe is no request: the coordinator's tables keep only the real ones
        await client.finish(probe)
    except RpcFailure:
        pass
    finally:
        await client.close()
    return None if admission.target is not None else "no target"


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
def lab_cluster(workdir: Path, etcd_members: int, etcd_tmpfs_mib: int | None = None,
                state_tmpfs_mib: dict[str, int] | None = None, relay_etcd: bool = False,
                relay_etcd_peers: bool = False, relay_node_peers: bool = False
                ) -> Iterator[tuple[NetLab, Cluster]]:
    """A lab with `etcd_members` etcd members and 3 lumend nodes, removed afterwards
    (`state_tmpfs_mib`: node name -> the size of a tmpfs for its state dir; `relay_etcd`:
    every node reaches etcd through a delay relay on its host; `relay_etcd_peers`: etcd
    members reach each other through delay relays; `relay_node_peers`: the same between
    nodes)."""
    lab = NetLab(workdir)
    try:
        yield lab, Cluster(lab, etcd_members=etcd_members, nodes=3,
                           etcd_tmpfs_mib=etcd_tmpfs_mib, state_tmpfs_mib=state_tmpfs_mib,
                           relay_etcd=relay_etcd, relay_etcd_peers=relay_etcd_peers,
                           relay_node_peers=relay_node_peers)
    finally:
        lab.close()


async def new_coordinator_and_admissions(cluster: Cluster, epoch: int, fault: float,
                                         row: Row) -> None:
    """Wait for a coordinator of a later term than `epoch`, then for admissions to resume;
    both noted in `row`, measured from `fault`."""
    new = await asyncio.to_thread(
        cluster.wait, lambda v: v.coordinator is not None and v.coordinator.epoch > epoch,
        60, "a new coordinator")
    assert new.coordinator is not None
    row.notes.append(f"new coordinator {new.coordinator.record.node} after "
                     f"{time.monotonic() - fault:.1f} s")
    row.admissions_resumed_s = await until_admissions_resume(cluster, fault, 30)


def coordinator_cut_off_from_etcd(workdir: Path, hold_s: float = 30.0) -> Row:
    """The coordinator's node loses etcd (a black hole, its peers still reachable). Its term
    must end (it stops answering Admit) and another node must be elected; streams through
    another node's gateway go on. Then, after at least `hold_s` (an outage long enough for
    connection backoff to grow: a node once froze for good after one of 60-90 s), the network
    heals and it must rejoin as a follower."""
    row = Row("coordinator's node black-holed from etcd")
    with lab_cluster(workdir, etcd_members=1) as (lab, cluster):
        view = cluster.ready(90, "3 nodes settled")
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
                await new_coordinator_and_admissions(cluster, epoch, fault, row)
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
        cluster.ready(90, "3 nodes settled")
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
        cluster.ready(90, "3 nodes settled")
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
        view = cluster.ready(90, "3 nodes settled")
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
        cluster.ready(90, "3 nodes settled")
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


@dataclass
class Watch:
    """What a watcher saw while a fault lasted: Admit probes answered and refused, the
    longest stretch without an answer, every (coordinator, epoch) in etcd."""

    answered: int = 0
    refused: int = 0
    longest_gap_s: float = 0.0
    terms: list[tuple[str, int]] = field(default_factory=list)
    why: dict[str, int] = field(default_factory=dict)  # refusals by reason

    def elections(self) -> int:
        return max(0, len(self.terms) - 1)

    def notes(self) -> list[str]:
        terms = " -> ".join(f"{n}@{e}" for n, e in self.terms) or "none seen"
        why = ", ".join(f"{n} {w}" for w, n in sorted(self.why.items()))
        return [f"{self.answered}/{self.answered + self.refused} Admit probes answered "
                f"(longest gap {self.longest_gap_s:.1f} s{'; refused: ' + why if why else ''})",
                f"{self.elections()} elections during the fault ({terms})"]


async def watch_while(cluster: Cluster, busy: Callable[[], bool], watch: Watch,
                      period_s: float = 0.5) -> None:
    """Probe Admit and read the coordinator every `period_s` while `busy()`."""
    last_answer = time.monotonic()
    while busy():
        why = await admit_refused(cluster)
        if why is None:
            watch.answered += 1
            last_answer = time.monotonic()
        else:
            watch.refused += 1
            watch.why[why] = watch.why.get(why, 0) + 1
            watch.longest_gap_s = max(watch.longest_gap_s, time.monotonic() - last_answer)
        try:
            view = await asyncio.to_thread(cluster.view)
            if view.coordinator is not None:
                term = (view.coordinator.record.node, view.coordinator.epoch)
                if not watch.terms or watch.terms[-1] != term:
                    watch.terms.append(term)
        except Exception:
            pass
        await asyncio.sleep(period_s)


def packet_loss(workdir: Path, percent: int, hold_s: float = 20.0) -> Row:
    """`percent` % of the packets between every node and etcd, and between every two nodes,
    vanish (at random, each direction on its own) for at least `hold_s` and while 8 streams
    run. Streams must come out identical and admissions go on; the coordinator should stay
    (or be re-elected): the row counts the elections. The nft counters prove the loss was
    there (the control: a row with no drops is void)."""
    row = Row(f"{percent}% packet loss, every node to etcd and to its peers")
    with lab_cluster(workdir, etcd_members=1) as (lab, cluster):
        view = cluster.ready(90, "3 nodes settled")
        assert view.coordinator is not None
        watch = Watch(terms=[(view.coordinator.record.node, view.coordinator.epoch)])
        hosts = [m.host for m in cluster.etcd] + [n.host for n in cluster.nodes]
        links = [(n.host, m.host) for n in cluster.nodes for m in cluster.etcd] + [
            (a.host, b.host) for i, a in enumerate(cluster.nodes) for b in cluster.nodes[i + 1:]]

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                load = Load(cluster.nodes[0].gateway)
                await load.start(session)
                fault = time.monotonic()
                for a, b in links:
                    lab.lossy(a, b, percent)
                finished = asyncio.create_task(load.finish(row))
                await watch_while(cluster, lambda: not finished.done()
                                  or time.monotonic() - fault < hold_s, watch)
                await finished
                row.notes.append(f"{sum(h.dropped() for h in hosts)} packets dropped in "
                                 f"{time.monotonic() - fault:.0f} s")
                for a, b in links:
                    lab.lossy(a, b, 0)
                healed = time.monotonic()
                await asyncio.to_thread(cluster.wait, cluster.settled, 60, "settled again")
                row.notes.append(f"settled {time.monotonic() - healed:.1f} s after the loss")

        asyncio.run(run())
        row.admissions_resumed_s = watch.longest_gap_s
        row.notes[:0] = watch.notes()
        row.etcd_db_bytes = cluster.db_bytes()
        return row


def round_trip_s(url: str, tries: int = 3) -> float:
    """The fastest of `tries` round trips of etcd's `/version` at `url` (a new connection
    each, so the connect is in it too)."""
    best = float("inf")
    for _ in range(tries):
        began = time.monotonic()
        with urllib.request.urlopen(f"{url}/version", timeout=10) as r:
            r.read()
        best = min(best, time.monotonic() - began)
    return best


def etcd_rtt_delay(workdir: Path, one_way_ms: int = 100, hold_s: float = 20.0) -> Row:
    """Every node reaches etcd through a relay on its own host (`DelayProxy`); under load
    (8 streams) the relays delay each chunk by `one_way_ms` each way, a round trip to etcd
    2 x that longer, for at least `hold_s` and while the streams run. Streams must come out
    identical and admissions go on (the row counts refused probes and elections, as the loss
    rows do). The control: the relays delayed what they carried (their counts) and a round
    trip through one took at least 2 x `one_way_ms` (one straight to etcd: in the notes)."""
    row = Row(f"node-etcd RTT +{2 * one_way_ms} ms (every node)")
    marks: dict[str, int] = {}
    with lab_cluster(workdir, etcd_members=1, relay_etcd=True) as (_lab, cluster):
        view = cluster.ready(90, "3 nodes settled")
        assert view.coordinator is not None
        watch = Watch(terms=[(view.coordinator.record.node, view.coordinator.epoch)])
        relays = [r for n in cluster.nodes for r in n.etcd_relays]

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                load = Load(cluster.nodes[0].gateway)
                await load.start(session)
                marks.update({n.name: len(n.log_text()) for n in cluster.nodes})
                fault = time.monotonic()
                for relay in relays:
                    relay.delay(one_way_ms)
                await asyncio.sleep(0.3)  # the relays read their control ten times a second
                direct = await asyncio.to_thread(round_trip_s, cluster.endpoints[0])
                relayed = await asyncio.to_thread(round_trip_s, relays[0].url)
                row.notes.append(f"a round trip to etcd {relayed * 1000:.0f} ms through a "
                                 f"relay, {direct * 1000:.0f} ms straight")
                if relayed < 2 * one_way_ms / 1000:
                    row.notes.append("VOID: the relay did not delay the round trip")
                finished = asyncio.create_task(load.finish(row))
                await watch_while(cluster, lambda: not finished.done()
                                  or time.monotonic() - fault < hold_s, watch)
                await finished
                delayed = sum(r.stats()["chunks_delayed"] for r in relays)
                row.notes.append(f"{delayed} chunks delayed in {time.monotonic() - fault:.0f} s")
                if delayed == 0:
                    row.notes.append("VOID: the relays delayed nothing")
                for relay in relays:
                    relay.delay(0)
                healed = time.monotonic()
                await asyncio.to_thread(cluster.wait, cluster.settled, 60, "settled again")
                row.notes.append(f"settled {time.monotonic() - healed:.1f} s after the delay")
                named = sum(any("etcd unreachable" in line and "request_timeout_s" in line
                                for line in n.log_text()[marks[n.name]:].splitlines())
                            for n in cluster.nodes)
                row.notes.append(f"{named} of {len(cluster.nodes)} nodes' logs name "
                                 "[etcd] request_timeout_s")

        asyncio.run(run())
        row.admissions_resumed_s = watch.longest_gap_s
        row.notes[:0] = watch.notes()
        row.etcd_db_bytes = cluster.db_bytes()
        return row


def lumenctl_status(cluster: Cluster) -> tuple[int, str]:
    """`lumenctl status`'s exit code and its last lines, as an operator would run it."""
    done = subprocess.run([sys.executable, "-m", "lumenctl", "--endpoints",
                           ",".join(cluster.endpoints), "--cluster", cluster.name, "status"],
                          capture_output=True, text=True, timeout=60)
    text = (done.stdout + done.stderr).strip()
    return done.returncode, " / ".join(line.strip() for line in text.splitlines()[-3:])


def first_line(text: str, *needles: str) -> str | None:
    for line in text.splitlines():
        if any(n in line for n in needles):
            return line.strip()[:240]
    return None


def said_since(node: Node, mark: int, most: int = 2) -> str:
    """The node's distinct WARNING/ERROR messages logged after `mark` (characters), first
    `most` of them, without timestamps: what an operator reads in the journal."""
    seen: list[str] = []
    for line in node.log_text()[mark:].splitlines():
        if " WARNING " in line or " ERROR " in line or " CRITICAL " in line:
            text = line.split(" ", 2)[-1].split(": ", 1)[-1][:110]
            if text not in seen:
                seen.append(text)
    return f"{node.name}: " + ("; ".join(seen[:most]) or "nothing") + (
        f" (+{len(seen) - most} more)" if len(seen) > most else "")


def add_up(row: Row, more: Row) -> None:
    """Count `more`'s streams into `row`."""
    row.streams += more.streams
    row.completed += more.completed
    row.identical += more.identical
    row.lost += more.lost
    row.duplicated += more.duplicated
    row.notes += more.notes


def etcd_disk_full(workdir: Path, tmpfs_mib: int = 200, down_s: float = 10.0) -> Row:
    """The single etcd member's data dir is a small tmpfs; under load (8 streams, the nodes'
    heartbeats) its free space is taken. etcd cannot commit and exits (3.4: `cannot commit
    tx ... no space left on device`). lumend must keep serving (streams in flight identical,
    new streams admitted by the gateways locally), say what is wrong in its log and in
    `lumenctl status`, and recover once space is freed and etcd restarted (as systemd
    would). The control: etcd really ran out of space (its exit and its log say so)."""
    row = Row("etcd's disk full (its only member exits), then space freed")
    with lab_cluster(workdir, etcd_members=1, etcd_tmpfs_mib=tmpfs_mib) as (_lab, cluster):
        view = cluster.ready(90, "3 nodes settled")
        assert view.coordinator is not None
        epoch = view.coordinator.epoch
        [member] = cluster.etcd
        assert member.proc is not None
        etcd_log = cluster.lab.workdir / f"{member.name}.log"

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                load = Load(cluster.nodes[0].gateway)
                await load.start(session)
                marks = {n.name: len(n.log_text()) for n in cluster.nodes}
                await asyncio.to_thread(member.disk().fill, 0)
                fault = time.monotonic()
                while member.proc is not None and member.proc.poll() is None:
                    if time.monotonic() - fault > 60:
                        row.notes.append("VOID: etcd still running 60 s after its disk "
                                         "filled")
                        await load.finish(row)
                        return
                    await asyncio.sleep(0.1)
                exited = time.monotonic()
                why = first_line(etcd_log.read_text(errors="replace"), "no space left")
                said = "no ENOSPC in its log" if why is None else why.split(" | ", 1)[-1]
                row.notes.append(f"etcd exited {exited - fault:.1f} s after the fill, under "
                                 f"the nodes' own writes ({said[:90]})")
                if why is None:
                    row.notes.append("VOID: etcd did not run out of space")
                # New streams while etcd is gone: the gateways must admit them locally.
                late = Load(cluster.nodes[1].gateway)
                late.prompts = [f"{p} (sent while etcd is out of space)" for p in late.prompts]
                await late.start(session)
                await asyncio.sleep(max(0.0, down_s - (time.monotonic() - exited)))
                code, said = await asyncio.to_thread(lumenctl_status, cluster)
                row.notes.append(f"lumenctl status exit {code}: {said[:60]}")
                dead = [n.name for n in cluster.nodes if n.proc and n.proc.poll() is not None]
                row.notes.append(f"lumend exited on {dead}" if dead else
                                 "every lumend still running")
                row.notes.append("node logs: " + " | ".join(
                    said_since(n, marks[n.name], most=1) for n in cluster.nodes))
                await asyncio.to_thread(member.disk().unfill)
                await asyncio.to_thread(member.start)
                restarted = time.monotonic()
                row.admissions_resumed_s = await until_admissions_resume(cluster, restarted, 60)
                row.notes.append("admissions measured from etcd's restart on freed space")
                await load.finish(row)
                more = Row("late")
                await late.finish(more)
                add_up(row, more)
                after = await asyncio.to_thread(cluster.wait, cluster.settled, 60,
                                                "settled again")
                assert after.coordinator is not None
                row.notes.append(f"settled {time.monotonic() - restarted:.1f} s after the "
                                 f"restart, epoch {epoch} -> {after.coordinator.epoch}")
                code, said = await asyncio.to_thread(lumenctl_status, cluster)
                row.notes.append(f"lumenctl status after: exit {code}")

        asyncio.run(run())
        row.etcd_db_bytes = cluster.db_bytes()
        return row


def proc_state(pid: int) -> str:
    """The process's state letter in /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]


def coordinator_paused_past_its_ttl(workdir: Path, pause_s: float = 10.0) -> Row:
    """The coordinator's lumend is SIGSTOPped (its engine and the network go on) for
    `pause_s`, past its lease TTL (3 s), with one Admit sent to it while it is stopped;
    then SIGCONT. Another node must be elected while it sleeps; streams through another
    gateway go on (those on its engine too); after SIGCONT the Admit queued on its socket
    must not be answered with a target for the old epoch, and it must rejoin as a
    follower. The control: the coordinator really was stopped (its state is T)."""
    row = Row("coordinator's lumend SIGSTOPped past its TTL, then SIGCONT")
    with lab_cluster(workdir, etcd_members=1) as (_lab, cluster):
        view = cluster.ready(90, "3 nodes settled")
        assert view.coordinator is not None
        old, epoch = cluster.node(view.coordinator.record.node), view.coordinator.epoch
        via = next(n for n in cluster.nodes if n is not old)

        async def queued_admit() -> str:
            client = CoordinatorClient(old.rpc)
            try:
                admission = await client.admit(f"queued-{time.monotonic_ns()}", None, "chaos",
                                               timeout_s=pause_s + 20)
                return f"ANSWERED FOR THE OLD EPOCH: {admission.target}"
            except RpcFailure as exc:
                return f"refused ({exc.code})"
            finally:
                await client.close()

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                load = Load(via.gateway)
                await load.start(session)
                fault = time.monotonic()
                old.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
                await asyncio.sleep(0.1)
                state = proc_state(old.pid)
                if state != "T":
                    row.notes.append(f"VOID: the coordinator is not stopped (state {state})")
                queued = asyncio.create_task(queued_admit())
                await new_coordinator_and_admissions(cluster, epoch, fault, row)
                await asyncio.sleep(max(0.0, pause_s - (time.monotonic() - fault)))
                old.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
                woke = time.monotonic()
                row.notes.append(f"the Admit queued while it slept: {await queued}")
                if not await old_coordinator_refuses(old):
                    row.notes.append("THE OLD COORDINATOR STILL ANSWERS ADMIT")
                await load.finish(row)
                await asyncio.to_thread(cluster.wait, cluster.settled, 60,
                                        "the old coordinator back as a follower")
                row.notes.append(f"old coordinator a follower {time.monotonic() - woke:.1f} s "
                                 "after SIGCONT")

        asyncio.run(run())
        row.etcd_db_bytes = cluster.db_bytes()
        return row


def gateway_node_killed_under_load(workdir: Path) -> Row:
    """8 streams through each of two gateways (two nodes that are not the coordinator); one
    of the nodes is SIGKILLed (lumend, and with it its engine). Its own clients' streams are
    cut (their connection dies: counted apart, in the notes); the other gateway's streams
    (some on the dead node's engine) must come out identical, and the coordinator must forget
    the dead gateway's requests (`lumen_coordinator_requests` back to 0 once the survivors'
    streams ended). The control: the coordinator counted them before the kill."""
    row = Row("a gateway's node SIGKILLed under load (the other gateway's streams)")
    with lab_cluster(workdir, etcd_members=1) as (_lab, cluster):
        view = cluster.ready(90, "3 nodes settled")
        assert view.coordinator is not None
        leader = cluster.node(view.coordinator.record.node)
        victim, survivor = [n for n in cluster.nodes if n is not leader]

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                doomed, kept = Load(victim.gateway), Load(survivor.gateway)
                doomed.prompts = [f"{p} through the doomed gateway" for p in doomed.prompts]
                await asyncio.gather(doomed.start(session), kept.start(session))
                counted = await asyncio.to_thread(metric, leader, "lumen_coordinator_requests")
                row.notes.append(f"coordinator counted {counted} requests before the kill")
                if counted is None or counted < 2 * STREAMS:
                    row.notes.append("VOID: the coordinator did not count both gateways' "
                                     "streams")
                running = await asyncio.to_thread(streams_in_flight, survivor)
                there = sum(n for w, n in running.items() if w.startswith(victim.name + "-"))
                row.notes.append(f"{there:.0f} of the other gateway's streams on the killed "
                                 "node's engine")
                fault = time.monotonic()
                victim.proc.kill()  # type: ignore[union-attr]
                cut = Row("cut")
                await doomed.finish(cut)
                row.notes.append(f"through the killed gateway: {cut.lost} of {cut.streams} "
                                 "streams cut (its clients must retry)")
                row.admissions_resumed_s = await until_admissions_resume(cluster, fault, 30)
                kept_done = asyncio.create_task(kept.finish(row))
                # Forgotten: the coordinator counts no more than the survivors still running.
                deadline = time.monotonic() + 60
                left = counted
                while time.monotonic() < deadline:
                    alive = sum(not t.done() for t in kept.tasks)
                    left = await asyncio.to_thread(metric, leader, "lumen_coordinator_requests")
                    if left is not None and left <= alive:
                        row.notes.append(f"coordinator forgot the dead gateway's requests "
                                         f"{time.monotonic() - fault:.1f} s after the kill")
                        break
                    await asyncio.sleep(0.25)
                else:
                    row.notes.append(f"COORDINATOR STILL COUNTS {left} REQUESTS 60 s later")
                await kept_done
                row.notes.append(f"{survivor.log_text().count('resuming request')} of the "
                                 "other gateway's streams resumed elsewhere")

        asyncio.run(run())
        row.etcd_db_bytes = cluster.db_bytes()
        return row


def active_engine_pid(view: ClusterView, worker: str) -> int | None:
    record = view.workers.get(worker)
    if record is None or record.state != "serving":
        return None
    return next((e.pid for e in record.engines if e.role == "active" and e.pid), None)


WRITE_ONE_PAGE = ("import errno, os, sys\n"
                  "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND)\n"
                  "try:\n os.write(fd, b'x' * 4096); print('written')\n"
                  "except OSError as e:\n print(errno.errorcode[e.errno])")


async def fill_and_check_full(disk: Tmpfs, row: Row, what: str) -> None:
    """Fill `disk`; the control: a 4 KiB write there must then fail with ENOSPC (else the
    row is marked VOID, naming `what`)."""
    await asyncio.to_thread(disk.fill, 0)
    probe = await asyncio.to_thread(
        disk.run, sys.executable, "-c", WRITE_ONE_PAGE, str(disk.path / "probe"))
    if probe.stdout.strip() != "ENOSPC":
        row.notes.append(f"VOID: a write on {what} did not fail with ENOSPC "
                         f"({probe.stdout.strip()} {probe.stderr.strip()})")


def node_state_dir_full(workdir: Path, tmpfs_mib: int = 16) -> Row:
    """Every node's state dir (its engines' logs) is a small tmpfs. Under load (8 streams
    through node-1's gateway) the space of the node whose engine runs the most of them is
    taken, then that engine is SIGKILLed, so that lumend restarts it on the full disk (its
    streams resume elsewhere), and 8 more streams go through that node's gateway. lumend
    must not crash, its engine must serve again, every stream come out whole, and the
    node's log and metrics must say the disk is full. The control: the disk really was
    full (a write there fails with ENOSPC) and the engine really was restarted (a new
    pid)."""
    row = Row("a node's state dir out of space, its engine restarted on it")
    with lab_cluster(workdir, etcd_members=1, state_tmpfs_mib={
            f"node-{i}": tmpfs_mib for i in (1, 2, 3)}) as (_lab, cluster):
        cluster.ready(90, "3 nodes settled")

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                load = Load(cluster.nodes[0].gateway)
                await load.start(session)
                running = await asyncio.to_thread(streams_in_flight, cluster.nodes[0])
                worker = max(running, key=lambda w: running[w])
                victim = cluster.node(worker.rsplit("-w", 1)[0])
                disk = victim.state
                assert disk is not None
                row.notes.append(f"{victim.name}'s disk filled, {running[worker]:.0f} "
                                 f"streams on its engine")
                mark = len(victim.log_text())
                await fill_and_check_full(disk, row, "the full disk")
                filled = time.monotonic()
                said: str | None = None
                while said is None and time.monotonic() - filled < 10:
                    await asyncio.sleep(0.2)
                    said = first_line(victim.log_text()[mark:], "logs (", "is full")
                said = said and said.split(": ", 1)[-1].replace(str(disk.path), "state_dir")
                row.notes.append(f"lumend said {time.monotonic() - filled:.1f} s after the "
                                 f"fill: {said[:110]}" if said else
                                 "LUMEND SAID NOTHING OF THE FULL DISK in 10 s")
                view = await asyncio.to_thread(cluster.view)
                pid = active_engine_pid(view, worker)
                assert pid is not None, f"{worker} has no active engine: {summary(view)}"
                fault = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                admitting = asyncio.create_task(until_admissions_resume(cluster, fault, 30))
                back = await asyncio.to_thread(
                    cluster.wait, lambda v: active_engine_pid(v, worker) not in (None, pid),
                    60, f"{worker} serving again on the full disk")
                row.notes.append(f"{worker} serving again {time.monotonic() - fault:.1f} s "
                                 f"after the kill (pid {pid} -> "
                                 f"{active_engine_pid(back, worker)})")
                row.admissions_resumed_s = await admitting
                own = Load(victim.gateway)
                own.prompts = [f"{p} (admitted on a full disk)" for p in own.prompts]
                await own.start(session)
                await load.finish(row)
                more = Row("own")
                await own.finish(more)
                add_up(row, more)
                free = await asyncio.to_thread(metric, victim, "lumen_engine_log_free_bytes")
                row.notes.append(f"lumen_engine_log_free_bytes {free}")
                row.notes.append("lumend exited" if victim.proc is None
                                 or victim.proc.poll() is not None
                                 else "lumend still running")
                await asyncio.to_thread(disk.unfill)

        asyncio.run(run())
        row.etcd_db_bytes = cluster.db_bytes()
        return row


def packet_loss_10(workdir: Path) -> Row:
    return packet_loss(workdir, 10)


def packet_loss_30(workdir: Path) -> Row:
    return packet_loss(workdir, 30)


def etcd_rtt_1000ms(workdir: Path) -> Row:
    """A round trip to etcd past the nodes' `[etcd] request_timeout_s` (1 s in the lab)."""
    return etcd_rtt_delay(workdir, 500)


SCENARIOS: dict[str, Callable[[Path], Row]] = {
    "two-nodes-lost": two_nodes_lost_at_once,
    "coordinator-etcd-partition": coordinator_cut_off_from_etcd,
    "etcd-member-blackhole": etcd_member_black_holed,
    "node-peer-partition": node_cut_off_from_its_peers,
    "etcd-quorum-loss": etcd_quorum_lost_and_back,
    "packet-loss-10": packet_loss_10,
    "packet-loss-30": packet_loss_30,
    "etcd-disk-full": etcd_disk_full,
    "coordinator-paused": coordinator_paused_past_its_ttl,
    "gateway-node-killed": gateway_node_killed_under_load,
    "node-state-dir-full": node_state_dir_full,
    "etcd-rtt-200ms": etcd_rtt_delay,
    "etcd-rtt-1000ms": etcd_rtt_1000ms,
}
