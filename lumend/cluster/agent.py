"""The node's HA loop: lease, registration, heartbeats, election and the coordinator's duties.

One loop, Patroni-style: each cycle reads the cluster afresh (one atomic read), decides from
that snapshot alone, acts, and returns one sentence saying what it did. The sentence is the
log line and the node's published status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lumend import __version__
from lumend.cluster.election import Election
from lumend.cluster.fencing import EpochFence
from lumend.cluster.keys import Keys
from lumend.cluster.lease import LeaseKeeper
from lumend.cluster.models import (
    CoordinatorRecord,
    CoordinatorStatus,
    Event,
    NodeRecord,
    WorkerRecord,
    encode_value,
)
from lumend.cluster.store import (
    Delete,
    Op,
    Put,
    Store,
    StoreError,
    StoreUnavailable,
    WatchHandle,
)
from lumend.cluster.view import ClusterView, build_view

log = logging.getLogger(__name__)

EVENTS_KEPT = 1000


@dataclass(frozen=True)
class CycleReport:
    """One finished iteration of the HA loop, for the watchdog and metrics."""

    duration_s: float
    outcome: str  # "ok", "etcd_unavailable" or "etcd_error"


@dataclass(frozen=True)
class NodeIdentity:
    """What this node advertises; fixed for the life of the process."""

    name: str
    address: str
    gateway: str
    rpc: str
    checkpoint: str
    metrics: str


@dataclass(frozen=True)
class AgentTiming:
    lease_ttl_s: int
    heartbeat_s: float
    loop_s: float
    lease_margin_s: float | None = None

    @classmethod
    def for_ttl(cls, ttl_s: int, heartbeat_s: float | None = None) -> AgentTiming:
        heartbeat = heartbeat_s if heartbeat_s is not None else ttl_s / 3
        # Decisions (elections, handovers) are re-checked at least every second.
        return cls(lease_ttl_s=ttl_s, heartbeat_s=heartbeat, loop_s=min(1.0, heartbeat))


class ClusterAgent:
    def __init__(
        self,
        store: Store,
        keys: Keys,
        identity: NodeIdentity,
        timing: AgentTiming,
        workers: Callable[[], Sequence[WorkerRecord]] = lambda: (),
        *,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._keys = keys
        self._me = identity
        self._timing = timing
        self._workers = workers
        self._wall = wall_clock
        self._mono = monotonic
        self.lease = LeaseKeeper(
            store, timing.lease_ttl_s, margin_s=timing.lease_margin_s, clock=monotonic
        )
        self.election = Election(store, keys)
        self.fence = EpochFence()
        # Called with the new epoch on election and with None on stepping down, so the
        # node starts and stops its Coordinator service with the role.
        self.role_listeners: list[Callable[[int | None], None]] = []
        self._epoch: int | None = None
        self.status = "starting"
        self.view: ClusterView | None = None
        self._started_at = wall_clock()
        self._heartbeat_lease: int | None = None
        self._heartbeat_at = float("-inf")
        self._heartbeat_body: tuple[bytes, ...] = ()
        self._status_at = float("-inf")
        self._status_body = b""
        self._event_seq = 0
        self._reported_problems: set[str] = set()
        # Read by the daemon's watchdog, sd_notify and metrics (lumend/notify.py, metrics.py).
        self.cycles = 0
        self.last_cycle_at: float | None = None  # monotonic end of the last loop iteration
        self.elections_won = 0
        self.step_downs = 0
        self.keepalive_failures = 0
        self.cycle_listeners: list[Callable[[CycleReport], None]] = []
        # Woken by watches (see _arm_watch) rather than waiting for the next tick.
        self._wake = asyncio.Event()
        self._watches: dict[str, WatchHandle] = {}
        self._read_prefixes = [
            keys.nodes,
            keys.workers,
            keys.intents,
            keys.coordinator,  # also matches coordinator_status
            keys.config,
            keys.assists,
            keys.recoveries,
        ]
        # Extra coordinator duties: each gets the cycle's view and the epoch and returns the
        # writes it wants; they go into the cycle's epoch-guarded transaction.
        self.lead_duties: list[Callable[[ClusterView, int], Sequence[Op]]] = []

    @property
    def epoch(self) -> int | None:
        """The coordinator epoch this node holds, None while it follows."""
        return self._epoch

    @epoch.setter
    def epoch(self, value: int | None) -> None:
        if value == self._epoch:
            return
        self._epoch = value
        for listener in self.role_listeners:
            listener(value)

    @property
    def is_coordinator(self) -> bool:
        return self.epoch is not None

    @property
    def registered(self) -> bool:
        """Whether this node's keys are written on the lease it holds now."""
        return self.lease.held and self._heartbeat_lease == self.lease.lease_id

    # -- the loop -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        keepalive = asyncio.create_task(self._keepalive_loop(stop), name="lease-keepalive")
        backoff = _Backoff(0.5, 10.0)
        loop = asyncio.get_running_loop()
        try:
            while not stop.is_set():
                delay = self._timing.loop_s
                self._wake.clear()
                started = self._mono()
                outcome = "ok"
                try:
                    await self._arm_watch(loop)
                    sentence = await self.cycle()
                    backoff.reset()
                except StoreUnavailable as exc:
                    sentence = self._lost_contact(f"waiting for etcd at {', '.join(exc.endpoints)}"
                                                  f" ({exc.last})")
                    delay = backoff.next()
                    outcome = "etcd_unavailable"
                except StoreError as exc:
                    sentence = self._lost_contact(f"etcd refused a request: {exc}")
                    self.lease.forget()  # e.g. "lease not found": start over with a new lease
                    delay = backoff.next()
                    outcome = "etcd_error"
                self._say(sentence)
                self._cycle_done(CycleReport(self._mono() - started, outcome))
                await _pause(delay, stop, self._wake)
        finally:
            for watch in self._watches.values():
                watch.cancel()
            keepalive.cancel()
            await asyncio.gather(keepalive, return_exceptions=True)

    async def _arm_watch(self, loop: asyncio.AbstractEventLoop) -> None:
        # The coordinator key (a resignation or an expired lease is acted on at once) and
        # the policy settings (a `lumenctl config set` reaches the coordinator's next
        # decision without waiting for the next tick).
        for key in (self._keys.coordinator, self._keys.config):
            watch = self._watches.get(key)
            if watch is not None and watch.alive:
                continue

            def wake() -> None:  # runs on the watch's thread
                with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
                    loop.call_soon_threadsafe(self._wake.set)

            try:
                self._watches[key] = await self._store.watch_key(key, wake)
            except StoreError:
                self._watches.pop(key, None)  # polling still works; try again next cycle

    async def _keepalive_loop(self, stop: asyncio.Event) -> None:
        warned = False
        while not stop.is_set():
            try:
                if self.lease.held:
                    await self.lease.renew()
                warned = False
            except StoreError as exc:
                self.keepalive_failures += 1
                if not warned:
                    log.warning("lease keepalive failed: %s", exc)
                    warned = True
            await _pause(self._timing.lease_ttl_s / 3, stop)

    async def cycle(self) -> str:
        """One HA cycle: register if needed, read, decide, act. Returns what it did."""
        if not self.lease.held:
            self._step_down_quietly()
            lease = await self.lease.grant()
            log.info("granted etcd lease %x (ttl %d s)", lease, self.lease.ttl_s)
        # Heartbeat first, so a node is registered before it can win an election.
        await self._heartbeat(self.status)
        view = build_view(self._keys, await self._store.read_prefixes(self._read_prefixes))
        self.view = view
        self._report_problems(view)
        if view.coordinator is not None:
            self.fence.observe(view.coordinator.epoch)
        return await self._decide_role(view)

    async def _decide_role(self, view: ClusterView) -> str:
        current = view.coordinator
        mine = current is not None and current.lease == self.lease.lease_id
        if self.epoch is not None and (not mine or current is None or current.epoch != self.epoch):
            holder = f"{current.record.node} (epoch {current.epoch})" if current else "nobody"
            return self._step_down(f"the coordinator key now belongs to {holder}")
        if mine and current is not None and self.epoch is None and self.lease.confident():
            self.epoch = current.epoch  # ours (a campaign whose answer was lost, or resumed)
        if self.epoch is not None:
            if not self.lease.confident():
                return self._step_down(
                    f"lease not renewed for {self.lease.seconds_since_renewal():.1f} s "
                    f"(limit {self.lease.confident_for_s:.1f} s)"
                )
            return await self._lead(view)
        if current is None:
            if not self.lease.confident():
                return "not campaigning: the lease is not confirmed"
            return await self._campaign(view)
        return f"following coordinator {current.record.node} (epoch {current.epoch})"

    # -- coordinator --------------------------------------------------------------------

    async def _campaign(self, view: ClusterView) -> str:
        lease = self.lease.lease_id
        assert lease is not None
        record = CoordinatorRecord(
            node=self._me.name, address=self._me.address, rpc=self._me.rpc,
            elected_at=self._wall(),
        )
        epoch = await self.election.campaign(record, lease)
        if epoch is None:
            return "lost the election; following the winner"
        self.epoch = epoch
        self.elections_won += 1
        self.fence.observe(epoch)
        previous = view.coordinator_status
        after = f" after {previous.node} (epoch {previous.epoch})" if previous else ""
        log.info("elected coordinator, epoch %d%s", epoch, after)
        await self.election.guarded(
            epoch,
            [self._event("coordinator_elected", f"{self._me.name} became coordinator, "
                         f"epoch {epoch}{after}", epoch)],
        )
        await self._trim_events(epoch)
        return await self._lead(view)

    async def _lead(self, view: ClusterView) -> str:
        """The coordinator's duties that exist so far: membership history and its status."""
        epoch = self.epoch
        assert epoch is not None
        members = sorted(view.nodes)
        previous = view.coordinator_status
        ops: list[Op] = []
        for duty in self.lead_duties:
            ops += duty(view, epoch)
        if previous is not None:
            for node in sorted(set(members) - set(previous.members)):
                ops.append(self._event("node_joined", f"node {node} joined", epoch))
            for node in sorted(set(previous.members) - set(members)):
                ops.append(self._event("node_left", f"node {node} left (lease expired or "
                                       "stopped)", epoch))
        decision = (
            f"coordinating as {self._me.name} (epoch {epoch}): {len(members)} nodes, "
            f"{len(view.workers)} workers, {len(view.intents)} intents"
        )
        status = CoordinatorStatus(
            node=self._me.name, epoch=epoch, at=self._wall(), decision=decision, members=members
        )
        body = encode_value(
            CoordinatorStatus(node=status.node, epoch=epoch, at=0, decision=decision,
                              members=members)
        )
        due = self._mono() - self._status_at >= self._timing.heartbeat_s
        if ops or body != self._status_body or due:
            ops.append(Put(self._keys.coordinator_status, encode_value(status)))
            if not await self.election.guarded(epoch, ops):
                return self._step_down(f"a write guarded by epoch {epoch} was refused")
            self._status_at = self._mono()
            self._status_body = body
        return decision

    async def _trim_events(self, epoch: int) -> None:
        events = await self._store.get_prefix(self._keys.events)
        excess = len(events.kvs) - EVENTS_KEPT
        if excess > 0:
            await self.election.guarded(epoch, [Delete(kv.key) for kv in events.kvs[:excess]])

    def _step_down(self, why: str) -> str:
        epoch, self.epoch = self.epoch, None
        self.step_downs += 1
        sentence = f"stepped down as coordinator (epoch {epoch}): {why}"
        log.warning("%s", sentence)
        return sentence

    def _step_down_quietly(self) -> None:
        if self.epoch is not None:
            self._step_down("the lease is gone")

    def _lost_contact(self, why: str) -> str:
        if self.epoch is not None:
            self._step_down(why)
        return why

    # -- node and worker keys -------------------------------------------------------------

    async def _heartbeat(self, status: str) -> None:
        lease = self.lease.lease_id
        if lease is None:
            return
        node = self._node_record(status)
        workers = list(self._workers())
        body = (
            encode_value(_without_time(node)),
            *(encode_value(_without_time(w)) for w in workers),
        )
        due = self._mono() - self._heartbeat_at >= self._timing.heartbeat_s
        if lease == self._heartbeat_lease and body == self._heartbeat_body and not due:
            return
        ops: list[Op] = [Put(self._keys.node(node.name), encode_value(node), lease)]
        ops += [Put(self._keys.worker(w.name), encode_value(w), lease) for w in workers]
        await self._store.txn([], ops)
        if lease != self._heartbeat_lease:
            log.info("registered node %s with %d workers", node.name, len(workers))
        self._heartbeat_lease = lease
        self._heartbeat_at = self._mono()
        self._heartbeat_body = body

    def _node_record(self, status: str, state: str = "up") -> NodeRecord:
        me = self._me
        return NodeRecord(
            name=me.name, address=me.address, state="stopping" if state == "stopping" else "up",
            pid=os.getpid(), version=__version__, started_at=self._started_at,
            updated_at=self._wall(), gateway=me.gateway, rpc=me.rpc, checkpoint=me.checkpoint,
            metrics=me.metrics, workers=[w.name for w in self._workers()], status=status,
        )

    def _event(self, kind: str, message: str, epoch: int | None) -> Put:
        now = self._wall()
        self._event_seq = (self._event_seq + 1) % 10000
        key = self._keys.event(int(now * 1000), self._me.name, self._event_seq)
        event = Event(at=now, kind=kind, source=self._me.name, message=message, epoch=epoch)
        return Put(key, encode_value(event))

    # -- shutdown -------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Graceful stop: resign (so another node takes over at once) and drop the lease."""
        try:
            if self.epoch is not None:
                epoch = self.epoch
                self.epoch = None
                event = self._event("coordinator_resigned",
                                    f"{self._me.name} resigned as coordinator (epoch {epoch})",
                                    epoch)
                if await self.election.resign(epoch, [event]):
                    log.info("resigned as coordinator (epoch %d)", epoch)
            # Revoking deletes every key on the lease (node, workers) at once.
            await self.lease.revoke()
        except StoreError as exc:
            log.warning("could not deregister cleanly (%s); the lease will expire in %d s",
                        exc, self.lease.ttl_s)

    # -- logging --------------------------------------------------------------------------

    def _cycle_done(self, report: CycleReport) -> None:
        self.cycles += 1
        self.last_cycle_at = self._mono()
        for listener in self.cycle_listeners:
            listener(report)

    def _say(self, sentence: str) -> None:
        if sentence != self.status:
            log.info("%s", sentence)
            self.status = sentence

    def _report_problems(self, view: ClusterView) -> None:
        for problem in view.problems:
            text = str(problem)
            if text not in self._reported_problems:
                self._reported_problems.add(text)
                log.warning("skipping a value under the LUMEN prefix: %s", text)


def _without_time(record: NodeRecord | WorkerRecord) -> NodeRecord | WorkerRecord:
    """The record minus its timestamp, to tell whether anything else changed."""
    import msgspec

    return msgspec.structs.replace(record, updated_at=0.0)


class _Backoff:
    def __init__(self, first: float, cap: float) -> None:
        self._first = first
        self._cap = cap
        self._next = first

    def next(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self._cap)
        return delay

    def reset(self) -> None:
        self._next = self._first


async def _pause(seconds: float, *events: asyncio.Event) -> None:
    """Sleep `seconds`, or less if any of `events` is set."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
