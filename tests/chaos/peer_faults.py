"""Chaos scenarios on the links between peers (`scenarios.py` has the others): delay
between etcd members, delay between lumend nodes (gateway to engine, checkpoint streams to
the holder, Admit and Recover), and etcd members whose disks fill one after another. Each
returns a row of the fault matrix; the tests assert on the rows, `bench/chaos.py` prints
them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import aiohttp

from .netlab import CHECKPOINT, ENGINES, DelayProxy, EtcdMember, Node
from .scenarios import (
    Cluster,
    Load,
    Row,
    Watch,
    add_up,
    fill_and_check_full,
    first_line,
    lab_cluster,
    metric,
    streams_in_flight,
    watch_while,
)


def http_round_trip_s(url: str, tries: int = 3) -> float:
    """The fastest of `tries` HTTP round trips to `url`, a new connection each (an error
    status is an answer too)."""
    best = float("inf")
    for _ in range(tries):
        began = time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=20) as r:
                r.read()
        except urllib.error.HTTPError:
            pass
        best = min(best, time.monotonic() - began)
    return best


def etcd_samples(member: EtcdMember) -> dict[str, float]:
    """The member's Prometheus samples (client port, not relayed), summed by name."""
    found: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"{member.client_url}/metrics", timeout=5) as r:
            lines = r.read().decode().splitlines()
    except OSError:
        return found
    for line in lines:
        if line and not line.startswith("#"):
            name = line.split("{")[0].split()[0]
            found[name] = found.get(name, 0.0) + float(line.split()[-1])
    return found


def etcdctl(endpoints: list[str], *args: str, timeout_s: float = 5.0
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["etcdctl", "--endpoints", ",".join(endpoints),
                           f"--command-timeout={timeout_s:.0f}s", *args],
                          capture_output=True, text=True, timeout=timeout_s + 10,
                          env={**os.environ, "ETCDCTL_API": "3"})


def etcd_leader(cluster: Cluster) -> EtcdMember | None:
    """The member that every answering member names as leader, or None."""
    done = etcdctl(cluster.endpoints, "endpoint", "status", "-w", "json")
    try:
        statuses = json.loads(done.stdout)
        ids = {s["Endpoint"]: s["Status"]["header"]["member_id"] for s in statuses}
        leaders = {s["Status"]["leader"] for s in statuses}
    except (ValueError, KeyError, TypeError):
        return None
    if len(leaders) != 1:
        return None
    [leader] = leaders
    return next((m for m in cluster.etcd if ids.get(m.client_url) == leader), None)


def quorum_write(endpoints: list[str], key: str) -> str:
    """Whether a write through `endpoints` commits (a quorum answers), and how long
    etcdctl took (its own start included)."""
    began = time.monotonic()
    done = etcdctl(endpoints, "put", key, str(time.time()))
    took = f"in {(time.monotonic() - began) * 1000:.0f} ms"
    return (f"committed {took}" if done.returncode == 0
            else f"FAILED {took} ({done.stderr.strip()[:80]})")


def write_until_committed(endpoints: list[str], key: str, since: float, what: str,
                          within_s: float = 30.0) -> str:
    """Writes through `endpoints` (2 s each) until one commits: when, from `since` (`what`
    happened then), and how many failed before (a quorum without a leader yet)."""
    failed = 0
    while time.monotonic() - since < within_s:
        if etcdctl(endpoints, "put", key, str(time.time()), timeout_s=2).returncode == 0:
            return (f"a write committed {time.monotonic() - since:.1f} s after {what}"
                    + (f" ({failed} failed before: no leader yet)" if failed else ""))
        failed += 1
    return f"NO WRITE COMMITTED within {within_s:.0f} s after {what} ({failed} failed)"


async def delayed(relays: list[DelayProxy], one_way_ms: float) -> None:
    for relay in relays:
        relay.delay(one_way_ms)
    await asyncio.sleep(0.3)  # the relays read their control ten times a second


async def under_delay(cluster: Cluster, row: Row, relays: list[DelayProxy], one_way_ms: int,
                      probe_url: str, where: str, hold_s: float,
                      during: Callable[[], list[str]] | None = None,
                      started: Callable[[Node], list[str]] | None = None) -> Watch:
    """8 streams through the gateway of a node that is not the coordinator, then
    `one_way_ms` on `relays` for at least `hold_s` and until 8 more streams, sent there
    once the delay is on, have ended. Admit probed twice a second meanwhile; the gateway's
    admissions counted, by who decided them. The control: a round trip to `probe_url`
    (through one of the relays) measured before and during the delay, and the chunks the
    relays held. `started(via)`: notes once the first streams run."""
    view = await asyncio.to_thread(cluster.ready, 90, "3 nodes settled")
    assert view.coordinator is not None
    watch = Watch(terms=[(view.coordinator.record.node, view.coordinator.epoch)])
    via = next(n for n in cluster.nodes if n.name != view.coordinator.record.node)

    def decided() -> tuple[float, float]:
        return (metric(via, "lumen_gateway_coordinated_total", 'call="admit"') or 0.0,
                metric(via, "lumen_gateway_degraded_total", 'call="admit"') or 0.0)

    async with aiohttp.ClientSession() as session:
        load = Load(via.gateway)
        await load.start(session)
        if started is not None:
            row.notes += await asyncio.to_thread(started, via)
        coordinated, local = await asyncio.to_thread(decided)
        marks = {n.name: len(n.log_text()) for n in cluster.nodes}
        before = await asyncio.to_thread(http_round_trip_s, probe_url)
        held_before = sum(r.stats()["chunks_delayed"] for r in relays)
        fault = time.monotonic()
        await delayed(relays, one_way_ms)
        measured = await asyncio.to_thread(http_round_trip_s, probe_url)
        row.notes.append(f"a round trip {where} {measured * 1000:.0f} ms with the delay, "
                         f"{before * 1000:.0f} ms before")
        if measured < 2 * one_way_ms / 1000:
            row.notes.append("VOID: the relays did not delay the round trip")
        late = Load(via.gateway)
        late.prompts = [f"{p} (sent during the delay)" for p in late.prompts]
        more = Row("late")

        async def both() -> None:
            await late.start(session)
            await asyncio.gather(load.finish(row), late.finish(more))

        finished = asyncio.create_task(both())
        await watch_while(cluster, lambda: not finished.done()
                          or time.monotonic() - fault < hold_s, watch)
        await finished
        add_up(row, more)
        coordinated_after, local_after = await asyncio.to_thread(decided)
        row.notes.append(f"the 8 streams sent during the delay through {via.name}'s gateway: "
                         f"{coordinated_after - coordinated:.0f} admitted by the coordinator, "
                         f"{local_after - local:.0f} decided locally")
        if during is not None:
            row.notes += during()
        held = sum(r.stats()["chunks_delayed"] for r in relays) - held_before
        row.notes.append(f"{held} chunks delayed in {time.monotonic() - fault:.0f} s")
        if held <= 0:
            row.notes.append("VOID: the relays delayed nothing")
        stepped = sum(n.log_text()[marks[n.name]:].count("stepped down as coordinator")
                      for n in cluster.nodes)
        row.notes.append(f"{stepped} coordinator step-downs logged during the delay")
        await delayed(relays, 0)
        healed = time.monotonic()
        await asyncio.to_thread(cluster.wait, cluster.settled, 60, "settled again")
        row.notes.append(f"settled {time.monotonic() - healed:.1f} s after the delay")
    return watch


def etcd_peer_rtt(workdir: Path, one_way_ms: int = 100, hold_s: float = 20.0) -> Row:
    """3 etcd members, each receiving its peers' traffic through a relay; under load the
    relays delay each chunk by `one_way_ms`, so a round trip between two members (a raft
    append and its answer, a follower's forwarded request) takes 2 x that longer; nodes
    reach etcd directly. Streams must come out identical; the row counts refused Admit
    probes, lumend elections, etcd's own leader changes (from its metrics) and a write's
    time before and under the delay. The control: a round trip to a member's peer port
    through its relay, and the chunks the relays held."""
    row = Row(f"etcd peer RTT +{2 * one_way_ms} ms (between every two members)")
    with lab_cluster(workdir, etcd_members=3, relay_etcd_peers=True) as (_lab, cluster):
        relays = [r for m in cluster.etcd for r in m.peer_relays]

        first: list[dict[str, float]] = []

        def before() -> list[str]:
            first.extend(etcd_samples(m) for m in cluster.etcd)
            return [f"a write {quorum_write(cluster.endpoints, 'chaos/peer-delay')} "
                    "before the delay"]

        def etcd_saw() -> list[str]:
            after = [etcd_samples(m) for m in cluster.etcd]
            changes = max(a.get("etcd_server_leader_changes_seen_total", 0)
                          - b.get("etcd_server_leader_changes_seen_total", 0)
                          for a, b in zip(after, first, strict=True))
            return [f"a write {quorum_write(cluster.endpoints, 'chaos/peer-delay')} "
                    "under it", f"{changes:.0f} etcd leader changes"]

        async def run() -> Watch:
            return await under_delay(cluster, row, relays, one_way_ms,
                                     f"{cluster.etcd[1].peer_url}/version",
                                     "to a member's peer port", hold_s, etcd_saw,
                                     lambda _via: before())

        watch = asyncio.run(run())
        row.admissions_resumed_s = watch.longest_gap_s
        row.notes[:0] = watch.notes()
        row.etcd_db_bytes = cluster.db_bytes()
        return row


def etcd_peer_rtt_1000ms(workdir: Path) -> Row:
    """A round trip between etcd members at its default election timeout (1 s)."""
    return etcd_peer_rtt(workdir, 500)


def node_peer_rtt(workdir: Path, one_way_ms: int = 100, hold_s: float = 20.0) -> Row:
    """3 nodes, each receiving what other hosts send to its RPC, checkpoint and engine ports
    through relays (gateways' streams from its engine, other engines' checkpoints to its
    holder, Admit/Recover/Progress to it as coordinator); under load they delay each chunk by
    `one_way_ms`. etcd is reached directly. Streams must come out identical, those through
    the delay too; the row counts refused Admit probes (they cross the delay too) and
    elections. The control: a round trip to another node's engine port through its relay,
    and the chunks the engine and checkpoint relays held."""
    row = Row(f"node-to-node RTT +{2 * one_way_ms} ms (engine streams, checkpoints, gRPC)")
    with lab_cluster(workdir, etcd_members=1, relay_node_peers=True) as (_lab, cluster):
        relays = [r for n in cluster.nodes for r in n.peer_relays]
        far = cluster.nodes[1]

        def what_crossed() -> list[str]:
            def held(port: int) -> int:
                return sum(r.stats()["chunks_delayed"] for n in cluster.nodes
                           for r in n.peer_relays if r.target.endswith(f":{port}"))
            notes = [f"{held(ENGINES)} engine-stream and {held(CHECKPOINT)} checkpoint "
                     "chunks delayed"]
            if held(ENGINES) == 0:
                notes.append("VOID: no stream crossed the delay")
            return notes

        def spread(via: Node) -> list[str]:
            running = streams_in_flight(via)
            away = sum(n for w, n in running.items() if not w.startswith(via.name + "-"))
            return [f"{away:.0f} of the first 8 streams on the other nodes' engines"]

        async def run() -> Watch:
            return await under_delay(cluster, row, relays, one_way_ms,
                                     f"http://{far.host.ip}:{ENGINES}/health",
                                     "to another node's engine port", hold_s, what_crossed,
                                     spread)

        watch = asyncio.run(run())
        row.admissions_resumed_s = watch.longest_gap_s
        row.notes[:0] = watch.notes()
        row.etcd_db_bytes = cluster.db_bytes()
        return row


def node_peer_rtt_1000ms(workdir: Path) -> Row:
    return node_peer_rtt(workdir, 500)


def etcd_disks_full_in_turn(workdir: Path, tmpfs_mib: int = 200) -> Row:
    """3 etcd members, each on a small tmpfs. Under load (8 streams) a follower's disk is
    filled; once it has exited (etcd 3.4 exits when it cannot commit), a write must still
    commit through the other two (quorum held), 8 streams are sent, then its space is freed
    and it is restarted (as systemd would) and must be healthy again. Then the same for
    the member that is leader then. The row says, per member, when it exited, how long
    after that a write committed (writes fail while the other two elect a leader), and when
    it was back. The control: a write to the full tmpfs fails with ENOSPC."""
    row = Row("etcd members' disks full one after another (a follower, then the leader), "
              "each freed")
    with lab_cluster(workdir, etcd_members=3, etcd_tmpfs_mib=tmpfs_mib) as (_lab, cluster):
        view = cluster.ready(90, "3 nodes settled")
        assert view.coordinator is not None
        watch = Watch(terms=[(view.coordinator.record.node, view.coordinator.epoch)])

        async def fill_and_free(member: EtcdMember, role: str,
                                session: aiohttp.ClientSession) -> None:
            assert member.proc is not None
            disk = member.disk()
            log = cluster.lab.workdir / f"{member.name}.log"
            mark = len(log.read_text(errors="replace"))
            await fill_and_check_full(disk, row, f"{member.name}'s full disk")
            filled = time.monotonic()
            while member.proc.poll() is None and time.monotonic() - filled < 60:
                await asyncio.sleep(0.1)
            why = first_line(log.read_text(errors="replace")[mark:], "no space left")
            said = "" if why is None else " ({}: no space left on device)".format(
                why.split(" | ", 1)[-1].split(" (write ", 1)[0][:50])
            if member.proc.poll() is None:
                row.notes.append(f"{member.name} ({role}) STILL RUNNING 60 s after its disk "
                                 f"filled{said}")
            else:
                row.notes.append(f"{member.name} ({role}) exited "
                                 f"{time.monotonic() - filled:.1f} s after the fill{said}")
            others = [m.client_url for m in cluster.etcd if m is not member]
            row.notes.append(await asyncio.to_thread(
                write_until_committed, others, f"chaos/{member.name}-down", time.monotonic(),
                f"{member.name} exited"))
            batch = Load(cluster.nodes[1].gateway)
            batch.prompts = [f"{p} (sent with {member.name} down)" for p in batch.prompts]
            await batch.start(session)
            more = Row("batch")
            await batch.finish(more)
            add_up(row, more)
            await asyncio.to_thread(disk.unfill)
            if member.proc.poll() is not None:
                await asyncio.to_thread(member.start)
            restarted = time.monotonic()
            while etcdctl([member.client_url], "endpoint", "health").returncode != 0:
                if time.monotonic() - restarted > 60:
                    row.notes.append(f"{member.name} NOT HEALTHY 60 s after its restart")
                    return
                await asyncio.sleep(0.2)
            row.notes.append(f"{member.name} healthy {time.monotonic() - restarted:.1f} s "
                             "after its restart on freed space")

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                load = Load(cluster.nodes[0].gateway)
                await load.start(session)
                done = asyncio.Event()
                watcher = asyncio.create_task(watch_while(cluster, lambda: not done.is_set(),
                                                          watch))
                leader = await asyncio.to_thread(etcd_leader, cluster)
                follower = next(m for m in cluster.etcd if m is not leader)
                await fill_and_free(follower, "a follower", session)
                leader = await asyncio.to_thread(etcd_leader, cluster)
                if leader is None:
                    row.notes.append("VOID: no etcd leader after the first member came back")
                else:
                    await fill_and_free(leader, "the leader", session)
                done.set()
                await watcher
                first = Row("first")
                await load.finish(first)
                add_up(row, first)
                await asyncio.to_thread(cluster.wait, cluster.settled, 60, "settled again")

        asyncio.run(run())
        row.admissions_resumed_s = watch.longest_gap_s
        row.notes[:0] = watch.notes()
        row.etcd_db_bytes = cluster.db_bytes()
        return row


SCENARIOS: dict[str, Callable[[Path], Row]] = {
    "etcd-peer-rtt-200ms": etcd_peer_rtt,
    "etcd-peer-rtt-1000ms": etcd_peer_rtt_1000ms,
    "node-peer-rtt-200ms": node_peer_rtt,
    "node-peer-rtt-1000ms": node_peer_rtt_1000ms,
    "etcd-disks-full-in-turn": etcd_disks_full_in_turn,
}
