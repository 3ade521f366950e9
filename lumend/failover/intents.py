"""Carries out the intents lumenctl writes for this node's workers.

Who orders: the coordinator. Each HA cycle it reads the intents from its fresh snapshot and
calls the Agent service of the worker's node (`Failover`, `Drain`), carrying its epoch, so
a deposed coordinator cannot order anything (lumend/coordinator/commands.py). A node acts
on an intent by itself only when no coordinator has been elected for longer than
`alone_after_s` (a lease TTL): then nobody else can.

`lumenctl failover WORKER`: carried out at most once per intent. The node claims the intent
before switching (a transaction that deletes it only if it is still the intent read, by its
create revision), so a repeated order, a second coordinator or the node's own fallback find
nothing left to do; a repeated order for the same intent is answered with the first
outcome. An order that names no intent (`requested_at` 0) has nothing to claim and is
refused. The outcome is recorded as an event, which `lumenctl failover --wait` reports.

The claim writes, in the same transaction, a `failover_claimed` event whose value is unique
to the attempt; when the claim's answer is lost (etcd may have applied it), the node reads
that event back instead of sending the claim again: present, the claim is ours; absent
with the intent still pending, nothing was applied and the claim is sent again; absent
with the intent gone, another claimed it.

`lumenctl drain NODE|WORKER`: admissions stop wherever the intent is seen (coordinator,
gateways); the gateways move streams off the worker when it says --migrate. The node's part,
once the coordinator has told it (Agent Drain), is to publish its drained workers as
`draining` while requests are in flight there and `drained` once none are (what `lumenctl
drain --wait` watches), and to record the moment a worker became empty as an event. The
intent stays until `lumenctl undrain`; the coordinator then tells the node to undo it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp
import msgspec

from lumend.cluster.keys import Keys
from lumend.cluster.models import Event, Intent, WorkerRecord, decode_value, encode_value
from lumend.cluster.store import CommitUnknown, CreateRevisionIs, Delete, Put, Store, StoreError
from lumend.cluster.view import ClusterView
from lumend.failover.supervisor import WorkerSupervisor

log = logging.getLogger("lumend.failover")

EVENT_CLAIMED = "failover_claimed"
EVENT_DONE = "failover_done"
EVENT_REFUSED = "failover_refused"
EVENT_DRAINED = "drained"

# Outcomes of carried-out intents kept, to answer a repeated order with the first outcome.
OUTCOMES_KEPT = 256
# How often a claim whose answer was lost, and found not applied, is sent again.
CLAIM_ATTEMPTS = 3


class IntentGone(Exception):
    """The failover intent an order names is no longer pending: carried out already (by
    this node or another path) or withdrawn. Nothing is done."""


class FailoverFailed(RuntimeError):
    """The switchover was tried and did not complete (recorded as failover_refused)."""


class Leaderless:
    """How long the node's views have shown no coordinator (0 while one is elected)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: float | None = None

    def seconds(self, view: ClusterView) -> float:
        if view.coordinator is not None:
            self._since = None
            return 0.0
        now = self._clock()
        if self._since is None:
            self._since = now
        return now - self._since


class FailoverIntents:
    def __init__(self, node: str, store: Store, keys: Keys,
                 supervisors: dict[str, WorkerSupervisor],
                 view: Callable[[], ClusterView | None],
                 alone_after_s: float, leaderless: Leaderless | None = None) -> None:
        self._node = node
        self._store = store
        self._keys = keys
        self._supervisors = supervisors
        self._view = view
        self._alone_after_s = alone_after_s
        self.leaderless = leaderless or Leaderless()
        # Intents this node has claimed or is claiming, by (worker, requested_at): their
        # outcome, so that a repeated order is answered without a second switchover.
        self._outcomes: dict[tuple[str, float], asyncio.Task[tuple[str, float]]] = {}
        # Intents carried out, by path: "coordinator" (an Agent Failover) or "alone".
        self.carried_out: dict[str, int] = {"coordinator": 0, "alone": 0}
        self._claim_seq = 0
        # Claims whose answer was lost and not yet read back: (event key, its value).
        self._unsettled: dict[tuple[str, float], tuple[str, bytes]] = {}

    async def run(self, stop: asyncio.Event, every_s: float = 0.2) -> None:
        while not stop.is_set():
            self.act_alone()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
        for task in self._outcomes.values():
            task.cancel()

    def act_alone(self) -> list[asyncio.Task[tuple[str, float]]]:
        """With no coordinator elected for longer than `alone_after_s`, start this node's
        pending failover intents itself; returns the switchovers started."""
        view = self._view()
        if view is None:
            return []
        leaderless = self.leaderless.seconds(view)
        if leaderless <= self._alone_after_s:
            return []
        started = []
        for intent in view.intents:
            identity = (intent.target, intent.requested_at)
            if (intent.kind == "failover" and intent.target in self._supervisors
                    and identity not in self._outcomes):
                by = (f"intent of {intent.requested_by}, carried out by {self._node} alone: "
                      f"no coordinator for {leaderless:.1f} s")
                started.append(self._start(intent.target, intent.requested_at, by, "alone"))
        return started

    async def carry_out(self, worker: str, requested_at: float, by: str,
                        path: str = "coordinator") -> tuple[str, float]:
        """Carry out the failover intent for `worker` requested at `requested_at`, once:
        (the engine now active, seconds). A repeated call for the same intent waits for
        and returns the first call's outcome (or raises its error). Raises `IntentGone`
        when the intent is not pending, `FailoverFailed` when the switchover failed,
        `StoreError` when etcd could not be asked (nothing was done; try again)."""
        if requested_at <= 0:
            # Nothing to claim, so nothing could stop a second switchover: refused.
            raise IntentGone(f"the failover order for {worker} names no intent (requested_at "
                             f"{requested_at}); write one with `lumenctl failover {worker}`")
        task = self._outcomes.get((worker, requested_at))
        if task is None:
            task = self._start(worker, requested_at, by, path)
        # Shielded: an order whose caller gives up (a deadline, a coordinator stepping
        # down) must not leave a switchover half done.
        return await asyncio.shield(task)

    def _start(self, worker: str, requested_at: float, by: str,
               path: str) -> asyncio.Task[tuple[str, float]]:
        identity = (worker, requested_at)
        task = asyncio.create_task(self._claim_and_switch(worker, requested_at, by, path))
        self._outcomes[identity] = task

        def done(t: asyncio.Task[tuple[str, float]]) -> None:
            error = None if t.cancelled() else t.exception()
            # Nothing was claimed when etcd could not be asked: a later order may try again.
            if isinstance(error, StoreError) and self._outcomes.get(identity) is t:
                del self._outcomes[identity]

        task.add_done_callback(done)
        while len(self._outcomes) > OUTCOMES_KEPT:
            oldest = next(iter(self._outcomes))
            if not self._outcomes[oldest].done():
                break
            del self._outcomes[oldest]
        return task

    async def _claim_and_switch(self, worker: str, requested_at: float, by: str,
                                path: str) -> tuple[str, float]:
        if worker not in self._supervisors:
            raise IntentGone(f"no worker {worker!r} on node {self._node}")
        unsettled = self._unsettled.get((worker, requested_at))
        if unsettled is not None:
            # An earlier claim of this intent lost its answer and could not be read back:
            # if it landed, the intent is ours (and gone from etcd), so look for it first.
            event_key, event = unsettled
            written = await self._store.get(event_key)
            del self._unsettled[(worker, requested_at)]
            if written is not None and written.value == event:
                log.info("failover of %s: an earlier claim was applied (read back)", worker)
                self.carried_out[path] += 1
                return await self.failover(worker, by)
        key = self._keys.intent("failover", worker)
        kv = await self._store.get(key)
        pending: Intent | None = None
        if kv is not None:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                pending = decode_value(kv.value, Intent)
        if kv is None or pending is None or pending.requested_at != requested_at:
            raise IntentGone(f"no failover intent for {worker} requested at {requested_at:.3f} "
                             "is pending (carried out already, replaced or withdrawn)")
        if not await self._claim(worker, key, kv.create_revision, requested_at, by):
            raise IntentGone(f"the failover intent for {worker} was claimed or withdrawn "
                             "meanwhile")
        self.carried_out[path] += 1
        log.info("failover of %s: intent claimed (%s)", worker, by)
        return await self.failover(worker, by)

    async def _claim(self, worker: str, key: str, revision: int, requested_at: float,
                     by: str) -> bool:
        """The claim: delete the intent only if it is still the one read (same create
        revision), writing an event unique to this attempt with it. Whoever deletes it
        carries it out; everyone else finds it gone. True when this node claimed it."""
        for attempt in range(1, CLAIM_ATTEMPTS + 1):
            now = time.time()
            self._claim_seq = self._claim_seq % 9999 + 1
            event_key = self._keys.event(int(now * 1000), self._node, self._claim_seq)
            event = encode_value(Event(
                at=now, kind=EVENT_CLAIMED, source=self._node,
                message=f"{self._node} claimed the failover intent of {worker} requested at "
                        f"{requested_at:.3f} ({by}; attempt {attempt} at {now:.6f})"))
            try:
                result = await self._store.txn([CreateRevisionIs(key, revision)],
                                               [Delete(key), Put(event_key, event)],
                                               idempotent=False)
                return result.succeeded
            except CommitUnknown as exc:
                log.warning("failover of %s: %s", worker, exc)
            # Read back (plain reads, retried as usual): was the claim applied? Remembered
            # until known, so that a read back that fails too is settled by the next order.
            self._unsettled[(worker, requested_at)] = (event_key, event)
            written = await self._store.get(event_key)
            del self._unsettled[(worker, requested_at)]
            if written is not None and written.value == event:
                log.info("failover of %s: the claim was applied (read back)", worker)
                return True
            pending = await self._store.get(key)
            if pending is None or pending.create_revision != revision:
                return False  # another claimed or withdrew it
        raise CommitUnknown(f"claim of the failover intent for {worker}", "etcd",
                            f"{CLAIM_ATTEMPTS} answers lost")

    async def failover(self, worker: str, requested_by: str) -> tuple[str, float]:
        """Switch `worker` to a shadow and record the outcome as an event; returns (the
        engine now active, seconds). Raises `FailoverFailed` when it did not complete."""
        supervisor = self._supervisors[worker]
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                active, seconds = await supervisor.switchover(s)
        except (RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
            await self._record(EVENT_REFUSED,
                               f"failover of {worker} not done ({requested_by}): {exc}")
            raise FailoverFailed(str(exc) or type(exc).__name__) from None
        await self._record(EVENT_DONE, f"failover of {worker}: {active} active "
                           f"{seconds:.3f} s after the request ({requested_by})")
        return active, seconds

    async def _record(self, kind: str, message: str) -> None:
        log.info("%s", message)
        now = time.time()
        event = Event(at=now, kind=kind, source=self._node, message=message)
        try:
            await self._store.put(self._keys.event(int(now * 1000), self._node, 0),
                                  encode_value(event))
        except StoreError as exc:
            log.warning("could not record an event (%s): %s", message, exc)


def drain_intent(view: ClusterView, worker: WorkerRecord) -> Intent | None:
    """The drain intent naming the worker or its node (the worker's own first), if any."""
    intents = [i for i in view.intents_for(worker) if i.kind == "drain"]
    return min(intents, key=lambda i: i.target_kind != "worker", default=None)


def in_flight(worker: WorkerRecord) -> int:
    return worker.load.running + worker.load.waiting


class DrainStates:
    """A drained worker's published state: `draining` with requests in flight, `drained`
    without. Only a worker that would otherwise be published as serving changes (one that
    is starting, recovering or failed says so instead).

    Which workers are drained: `ordered`, the set the coordinator's Agent Drain commands
    keep (shared with the Agent service). With no coordinator for longer than
    `alone_after_s` the node sets it from the drain intents itself. With `alone_after_s`
    None the node always decides from the intents it sees (no control plane)."""

    def __init__(self, node: str, store: Store, keys: Keys,
                 view: Callable[[], ClusterView | None],
                 workers: Callable[[], list[WorkerRecord]],
                 alone_after_s: float | None = None,
                 leaderless: Leaderless | None = None) -> None:
        self._node = node
        self._store = store
        self._keys = keys
        self._view = view
        self._workers = workers
        self._alone_after_s = alone_after_s
        self.leaderless = leaderless or Leaderless()
        self.ordered: set[str] = set()
        # Intents whose worker was recorded empty, by (worker, requested_at): once each.
        self._recorded: set[tuple[str, float]] = set()
        self._seq = 0

    def is_drained(self, record: WorkerRecord, view: ClusterView) -> bool:
        if self._alone_after_s is None:
            return drain_intent(view, record) is not None
        return record.name in self.ordered

    def decorate(self, record: WorkerRecord) -> WorkerRecord:
        view = self._view()
        if view is None or record.state not in ("serving", "draining"):
            return record
        if not self.is_drained(record, view):
            return record
        state = "draining" if in_flight(record) else "drained"
        return msgspec.structs.replace(record, state=state)

    def act_alone(self) -> None:
        """With no coordinator for longer than `alone_after_s`: drain exactly the workers
        under a drain intent (and undrain the others), as a coordinator would order."""
        view = self._view()
        if view is None or self._alone_after_s is None:
            return
        leaderless = self.leaderless.seconds(view)
        if leaderless <= self._alone_after_s:
            return
        wanted = {w.name for w in self._workers() if drain_intent(view, w) is not None}
        if wanted != self.ordered:
            log.info("no coordinator for %.1f s: %s by this node's own reading of the drain "
                     "intents", leaderless, ", ".join(
                         [f"drained {n}" for n in sorted(wanted - self.ordered)]
                         + [f"undrained {n}" for n in sorted(self.ordered - wanted)]))
            self.ordered.clear()
            self.ordered.update(wanted)

    async def run(self, stop: asyncio.Event, every_s: float = 0.2) -> None:
        while not stop.is_set():
            self.act_alone()
            await self.record_drained()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)

    async def record_drained(self) -> None:
        """An event for each worker of this node that became empty under a drain intent."""
        view = self._view()
        if view is None:
            return
        for record in self._workers():
            intent = drain_intent(view, record)
            if intent is None or record.state != "drained":
                continue
            identity = (record.name, intent.requested_at)
            if identity in self._recorded:
                continue
            self._recorded.add(identity)
            seconds = max(0.0, time.time() - intent.requested_at)
            message = (f"worker {record.name} drained: no requests in flight "
                       f"{seconds:.1f} s after the drain of {intent.target_kind} "
                       f"{intent.target} was requested"
                       + (" (with --migrate)" if intent.migrate else ""))
            log.info("%s", message)
            now = time.time()
            event = Event(at=now, kind=EVENT_DRAINED, source=self._node, message=message)
            self._seq = self._seq % 9999 + 1  # 0 is the failover events' sequence
            try:
                await self._store.put(self._keys.event(int(now * 1000), self._node, self._seq),
                                      encode_value(event))
            except StoreError as exc:
                log.warning("could not record that %s is drained: %s", record.name, exc)
