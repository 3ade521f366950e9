"""The node's HA loop: lease, registration, heartbeats, election and the coordinator's duties.

One loop, Patroni-style: each cycle reads the cluster afresh (one atomic read), decides from
that snapshot alone, acts, and returns one sentence saying what it did. The sentence is the
log line and the node's published status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

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
    WorkerLoad,
    WorkerRecord,
    encode_value,
)
from lumend.cluster.store import (
    MAX_TXN_OPS,
    NOSPACE,
    NOSPACE_FIX,
    DeleteRange,
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
# While elected, the coordinator trims the events to EVENTS_KEPT this often (and once when
# elected), and compacts etcd's history: to the revision it read at the previous compaction,
# and never closer than COMPACT_KEEP_REVISIONS to the current one (so a reader a little
# behind is not refused), and checks etcd's alarms. Module constants until [etcd] has keys.
TRIM_EVERY_S = 60.0
COMPACT_EVERY_S = 300.0
COMPACT_KEEP_REVISIONS = 1000
# A worker record unchanged in every meaningful field is rewritten this often at most (its
# keys live on the lease; the rewrite only refreshes `updated_at` for `lumenctl status`).
WORKER_REFRESH_S = 60.0
# A worker record whose cumulative cost and step counters alone changed is written this
# often at most: the coordinator reads recent step times and rates from their growth between
# records (lumend.coordinator.estimates.StepTracker), which needs a record every few
# seconds, not one per heartbeat per busy engine.
COUNTER_REFRESH_S = 10.0


@dataclass(frozen=True)
class CycleReport:
    """One finished iteration of the HA loop, for the watchdog and metrics."""

    duration_s: float
    outcome: str  # "ok", "etcd_unavailable", "etcd_error" or "error" (unexpected)


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
        trim_every_s: float = TRIM_EVERY_S,
        compact_every_s: float = COMPACT_EVERY_S,
        compact_keep_revisions: int = COMPACT_KEEP_REVISIONS,
        worker_refresh_s: float = WORKER_REFRESH_S,
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
        self.fence = EpochFence(self._verify_epoch)
        # Called with the new epoch on election and with None on stepping down, so the
        # node starts and stops its Coordinator service with the role.
        self.role_listeners: list[Callable[[int | None], None]] = []
        self._epoch: int | None = None
        self.status = "starting"
        self.view: ClusterView | None = None
        self._started_at = wall_clock()
        self._heartbeat_lease: int | None = None
        # What each record last written looked like (coarsely, see _meaningful) and when.
        self._written: dict[str, tuple[bytes, float]] = {}
        self._counters: dict[str, bytes] = {}  # as last written
        self._worker_refresh_s = worker_refresh_s
        self.heartbeat_writes = 0  # records written by heartbeats (tests and metrics)
        # The coordinator's housekeeping: event trimming, compaction, alarms.
        self._trim_every_s = trim_every_s
        self._compact_every_s = compact_every_s
        self._compact_keep = compact_keep_revisions
        self._trimmed_at = float("-inf")
        self._compact_checked_at = float("-inf")
        self._compact_next: int | None = None  # revision read at the previous check
        self.compacted_revision = 0
        self.trim_failures = 0
        self.compact_failures = 0
        self.alarms: tuple[str, ...] = ()  # etcd's alarms at the last check
        self.store_status_db_bytes: int | None = None
        self._status_at = float("-inf")
        self._status_body = b""
        self._event_seq = 0
        # (kind, message) of events to write once this node leads (bounded).
        self._pending_events: list[tuple[str, str]] = []
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

    async def _verify_epoch(self, epoch: int) -> bool:
        """The fence's check of a higher epoch than seen: is it the coordinator key's
        create revision now? (One linearizable read; see lumend/cluster/fencing.py.)"""
        kv = await self._store.get(self._keys.coordinator)
        return kv is not None and kv.create_revision == epoch

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
                    if _is_nospace(exc):
                        # Not the lease's fault: keep it (keepalives still work) and say
                        # what clears the alarm.
                        self._note_alarms((NOSPACE,))
                        sentence = self._lost_contact(
                            f"etcd is out of space (NOSPACE alarm) and refuses writes; "
                            f"{NOSPACE_FIX}")
                    else:
                        sentence = self._lost_contact(f"etcd refused a request: {exc}")
                        self.lease.forget()  # e.g. "lease not found": start with a new one
                    delay = backoff.next()
                    outcome = "etcd_error"
                except Exception as exc:
                    # Nothing a cycle meets may end the HA loop: lumend would stop and take
                    # its engines with it. Treated as a lost contact, logged with its trace.
                    log.exception("HA cycle failed unexpectedly")
                    sentence = self._lost_contact(
                        f"unexpected error in the HA cycle: {type(exc).__name__}: {exc}")
                    delay = backoff.next()
                    outcome = "error"
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
        epoch = view.coordinator.epoch if view.coordinator is not None else None
        self.fence.rewound(view.revision, epoch)
        if epoch is not None:
            self.fence.observe(epoch)
        if self.alarms:  # an alarm was seen: look every cycle until it is cleared
            with contextlib.suppress(StoreError):
                status = await self._store.status()
                self._note_alarms(status.alarms)
        return await self._decide_role(view)

    async def _decide_role(self, view: ClusterView) -> str:
        current = view.coordinator
        mine = current is not None and current.lease == self.lease.lease_id
        if self.epoch is not None and (not mine or current is None or current.epoch != self.epoch):
            holder = f"{current.record.node} (epoch {current.epoch})" if current else "nobody"
            return self._step_down(f"the coordinator key now belongs to {holder}")
        if NOSPACE in self.alarms:
            # No write can land (etcd refuses them until an operator clears the alarm):
            # neither lead nor campaign, rather than resume and fail every cycle. The
            # gateways decide locally meanwhile; the alarm is read again each cycle.
            if self.epoch is not None:
                self._step_down("etcd is out of space (NOSPACE alarm)")
            return f"etcd is out of space (NOSPACE alarm) and refuses writes; {NOSPACE_FIX}"
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
        self._trimmed_at = float("-inf")  # trim at once: the last term may have stopped short
        self._compact_checked_at = float("-inf")
        return await self._lead(view)

    async def _lead(self, view: ClusterView) -> str:
        """The coordinator's duties that exist so far: membership history and its status."""
        epoch = self.epoch
        assert epoch is not None
        members = sorted(view.nodes)
        previous = view.coordinator_status
        # Each duty's writes stay together in one transaction; membership events one each.
        groups: list[list[Op]] = [list(duty(view, epoch)) for duty in self.lead_duties]
        if previous is not None:
            for node in sorted(set(members) - set(previous.members)):
                groups.append([self._event("node_joined", f"node {node} joined", epoch)])
            for node in sorted(set(previous.members) - set(members)):
                groups.append([self._event("node_left", f"node {node} left (lease expired "
                                           "or stopped)", epoch)])
        groups += [[self._event(kind, message, epoch)] for kind, message in self._pending_events]
        self._pending_events.clear()
        groups = [g for g in groups if g]
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
        if groups or body != self._status_body or due:
            # The status goes last: the members it lists are what the next cycle compares
            # with, so a batch that fails before it is written again, not lost.
            groups.append([Put(self._keys.coordinator_status, encode_value(status))])
            if not await self._guarded_batches(epoch, groups):
                return self._step_down(f"a write guarded by epoch {epoch} was refused")
            self._status_at = self._mono()
            self._status_body = body
        await self._housekeeping(epoch)
        return decision

    async def _guarded_batches(self, epoch: int, groups: Sequence[Sequence[Op]]) -> bool:
        """Write `groups` in epoch-guarded transactions of at most MAX_TXN_OPS operations,
        a group never split unless it alone is larger; False once one is refused."""
        for batch in _batches(groups, MAX_TXN_OPS):
            if not await self.election.guarded(epoch, batch):
                return False
        return True

    # -- the coordinator's housekeeping: events, compaction, alarms ----------------------

    async def _housekeeping(self, epoch: int) -> None:
        """Trim events and compact etcd when due. A failure here is logged, counted and
        tried again later; it never ends the term (a coordinator that cannot trim can
        still coordinate)."""
        now = self._mono()
        if now - self._trimmed_at >= self._trim_every_s:
            self._trimmed_at = now
            try:
                await self._trim_events(epoch)
            except StoreError as exc:
                self.trim_failures += 1
                log.warning("could not trim the events (tried again in %.0f s): %s",
                            self._trim_every_s, exc)
        if now - self._compact_checked_at >= self._compact_every_s:
            self._compact_checked_at = now
            try:
                await self._compact(epoch)
            except StoreError as exc:
                self.compact_failures += 1
                log.warning("could not compact etcd (tried again in %.0f s): %s",
                            self._compact_every_s, exc)

    async def _trim_events(self, epoch: int) -> int:
        """Keep the newest EVENTS_KEPT events: one range delete below the oldest kept key
        (event keys sort by time). Returns how many keys were above the limit (at least)."""
        newest = await self._store.keys(self._keys.events, limit=EVENTS_KEPT + 1,
                                        newest_first=True)
        if len(newest) <= EVENTS_KEPT:
            return 0
        oldest_kept = newest[EVENTS_KEPT - 1]
        if await self.election.guarded(epoch, [DeleteRange(self._keys.events, oldest_kept)]):
            log.info("trimmed the events to the newest %d", EVENTS_KEPT)
        return len(newest) - EVENTS_KEPT

    async def _compact(self, epoch: int) -> None:
        """Compact etcd's history, fenced: only while this node is confidently the
        coordinator of `epoch` (checked by a guarded transaction just before). Also reads
        etcd's alarms (NOSPACE) and database size."""
        status = await self._store.status()
        self.store_status_db_bytes = status.db_size_bytes
        self._note_alarms(status.alarms)
        target = min(self._compact_next or 0, status.revision - self._compact_keep)
        self._compact_next = status.revision
        if target <= self.compacted_revision:
            return
        if self.epoch != epoch or not self.lease.confident():
            return
        if not await self.election.guarded(epoch, []):
            return  # deposed: the next cycle steps down
        await self._store.compact(target)
        self.compacted_revision = target
        log.info("compacted etcd to revision %d (current %d, database %.1f MiB)", target,
                 status.revision, status.db_size_bytes / 2**20)

    def _note_alarms(self, alarms: tuple[str, ...]) -> None:
        if alarms == self.alarms:
            return
        raised = sorted(set(alarms) - set(self.alarms))
        cleared = sorted(set(self.alarms) - set(alarms))
        self.alarms = alarms
        for alarm in raised:
            log.error("etcd raised the %s alarm: it refuses every write until cleared; %s",
                      alarm, NOSPACE_FIX if alarm == NOSPACE else "see `etcdctl alarm list`")
        if cleared:
            message = f"etcd alarm {', '.join(cleared)} cleared"
            log.warning("%s", message)
            # Recorded by whichever term this node leads next (one may be the only record
            # of the outage: nothing could be written while it lasted).
            self._pending_events = [*self._pending_events[-9:], ("etcd_alarm_cleared",
                                                                 message)]

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
        """Write this node's records that changed meaningfully (see `_meaningful`), all of
        them on a new lease, the node record at least every two heartbeats (its
        `updated_at` is what `lumenctl status` shows as SEEN) and a worker record at least
        every `worker_refresh_s`; one whose counters alone grew, every COUNTER_REFRESH_S at
        most. Liveness is the lease's, not the writes': an unchanged
        record costs etcd nothing but its keepalive."""
        lease = self.lease.lease_id
        if lease is None:
            return
        node = self._node_record(status)
        now = self._mono()
        fresh_lease = lease != self._heartbeat_lease
        records: list[tuple[str, NodeRecord | WorkerRecord, float]] = [
            (self._keys.node(node.name), node, 2 * self._timing.heartbeat_s)]
        workers = list(self._workers())
        records += [(self._keys.worker(w.name), w, self._worker_refresh_s) for w in workers]
        ops: list[Op] = []
        written: list[tuple[str, bytes, bytes]] = []
        for key, record, refresh_s in records:
            body = _meaningful(record)
            last = self._written.get(key)
            if (fresh_lease or last is None or last[0] != body
                    or now - last[1] >= refresh_s
                    or (now - last[1] >= COUNTER_REFRESH_S
                        and self._counters.get(key) != _counters(record))):
                ops.append(Put(key, encode_value(record), lease))
                written.append((key, body, _counters(record)))
        if not ops:
            return
        for batch in _batches([ops], MAX_TXN_OPS):
            await self._store.txn([], batch)
        if fresh_lease:
            log.info("registered node %s with %d workers", node.name, len(workers))
            self._written.clear()
        self._heartbeat_lease = lease
        self.heartbeat_writes += len(written)
        for key, body, counters in written:
            self._written[key] = (body, now)
            self._counters[key] = counters

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


def _meaningful(record: NodeRecord | WorkerRecord) -> bytes:
    """What of a record, if it changed, is worth a write: everything but its timestamp,
    with the load and checkpoint figures coarsened so that their jitter is not.

    Who reads those figures, and why coarse is enough: the coordinator takes a worker's
    queue as max(running + waiting here, the requests it admitted there itself) and its
    checkpoint bytes as max(bytes here, what the holders' progress streams reported), so
    these are a floor it corrects from first-hand counts (lumend/coordinator/service.py);
    the gateways' fallback routing and `lumenctl status` only rank and show them. Exact
    where a decision turns on the value: states, engines, zero versus non-zero requests
    (what `drain --wait` waits for), draft-assist counters (copied into the assignment);
    requests within 1/8 above 16; kv usage in 5% steps; checkpoint bytes in 1/32 of the
    budget (any non-zero amount at least one step). The cumulative cost and step counters
    (COUNTERS) only as exported or not: they grow at every step of a busy engine and are
    written on their own schedule (COUNTER_REFRESH_S)."""
    if isinstance(record, NodeRecord):
        return encode_value(msgspec.structs.replace(record, updated_at=0.0))
    load = record.load
    coarse_load = msgspec.structs.replace(
        load, running=_coarse(load.running), waiting=_coarse(load.waiting),
        kv_usage=round(load.kv_usage * 20) / 20,
        ckpt_running=None if load.ckpt_running is None else _coarse(load.ckpt_running),
        ckpt_complete=None if load.ckpt_complete is None else _coarse(load.ckpt_complete),
        **{name: None if getattr(load, name) is None else 0 for name in COUNTERS})
    ckpt = record.checkpoints
    step = max(1, ckpt.budget_bytes // 32)
    coarse_ckpt = msgspec.structs.replace(
        ckpt, bytes_held=math.ceil(ckpt.bytes_held / step), requests=_coarse(ckpt.requests))
    return encode_value(msgspec.structs.replace(
        record, updated_at=0.0, load=coarse_load, checkpoints=coarse_ckpt))


COUNTERS = ("restored_bytes", "restored_tokens", "restore_s", "prefill_tokens", "prefill_s",
            "step_s", "steps", "step_fit")


def _counters(record: NodeRecord | WorkerRecord) -> bytes:
    """A worker record's cumulative counters (COUNTER_REFRESH_S); b"" for a node record."""
    if isinstance(record, NodeRecord):
        return b""
    return encode_value(msgspec.structs.replace(
        WorkerLoad(), **{name: getattr(record.load, name) for name in COUNTERS}))


def _coarse(n: int) -> int:
    """`n` exactly up to 16, above that to its top four bits (steps of at most 1/8)."""
    if n <= 16:
        return n
    shift = n.bit_length() - 4
    return (n >> shift) << shift


def _batches(groups: Sequence[Sequence[Op]], limit: int) -> list[list[Op]]:
    """Pack `groups` in order into lists of at most `limit` operations, splitting a group
    only when it alone is larger than `limit`."""
    batches: list[list[Op]] = []
    current: list[Op] = []
    for group in groups:
        if len(current) + len(group) > limit and current:
            batches.append(current)
            current = []
        for op in group:
            if len(current) == limit:
                batches.append(current)
                current = []
            current.append(op)
    if current:
        batches.append(current)
    return batches


def _is_nospace(exc: StoreError) -> bool:
    return "database space exceeded" in str(exc)  # etcd: mvcc: database space exceeded


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
