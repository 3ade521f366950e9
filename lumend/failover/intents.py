"""Carries out the intents lumenctl writes for this node's workers.

`lumenctl failover WORKER`: the intent is read from the node's fresh cluster view each
cycle; the switchover runs once per intent; the intent is then removed and the outcome
recorded as an event, in one transaction, so `lumenctl failover --wait` can report it.

`lumenctl drain NODE|WORKER`: admissions stop wherever the intent is seen (coordinator,
gateways); the gateways move streams off the worker when it says --migrate. The node's part
is to publish its drained workers as `draining` while requests are in flight there and
`drained` once none are (what `lumenctl drain --wait` watches), and to record the moment a
worker became empty as an event. The intent stays until `lumenctl undrain`.
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
from lumend.cluster.models import Event, Intent, WorkerRecord, encode_value
from lumend.cluster.store import Delete, Put, Store, StoreError
from lumend.cluster.view import ClusterView
from lumend.failover.supervisor import WorkerSupervisor

log = logging.getLogger("lumend.failover")

EVENT_DONE = "failover_done"
EVENT_REFUSED = "failover_refused"
EVENT_DRAINED = "drained"


class FailoverIntents:
    def __init__(self, node: str, store: Store, keys: Keys,
                 supervisors: dict[str, WorkerSupervisor],
                 view: Callable[[], ClusterView | None]) -> None:
        self._node = node
        self._store = store
        self._keys = keys
        self._supervisors = supervisors
        self._view = view
        self._running: dict[str, asyncio.Task[None]] = {}
        # Intents already carried out, by (worker, requested_at): the view that still shows
        # one may be older than the transaction that removed it.
        self._handled: set[tuple[str, float]] = set()

    async def run(self, stop: asyncio.Event, every_s: float = 0.2) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            while not stop.is_set():
                self.start_new(session)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), every_s)
            for task in self._running.values():
                task.cancel()

    def start_new(self, session: aiohttp.ClientSession) -> None:
        view = self._view()
        if view is None:
            return
        for intent in view.intents:
            identity = (intent.target, intent.requested_at)
            if (intent.kind == "failover" and intent.target in self._supervisors
                    and intent.target not in self._running and identity not in self._handled):
                self._handled.add(identity)
                worker = intent.target
                task = asyncio.create_task(self._switch(session, worker))
                self._running[worker] = task
                task.add_done_callback(self._finished(worker))

    def _finished(self, worker: str) -> Callable[[asyncio.Task[None]], None]:
        def done(_: asyncio.Task[None]) -> None:
            self._running.pop(worker, None)

        return done

    async def _switch(self, session: aiohttp.ClientSession, worker: str) -> None:
        with contextlib.suppress(RuntimeError, aiohttp.ClientError, TimeoutError):
            await self.failover(worker, "a failover intent", session)

    async def failover(self, worker: str, requested_by: str,
                       session: aiohttp.ClientSession | None = None) -> tuple[str, float]:
        """Switch `worker` to a shadow and record the outcome as an event (removing a
        failover intent for it, if any); returns (the engine now active, seconds). Used for
        intents and for the Agent service's Failover command; raises on failure."""
        supervisor = self._supervisors[worker]
        try:
            if session is None:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                    active, seconds = await supervisor.switchover(s)
            else:
                active, seconds = await supervisor.switchover(session)
        except (RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
            await self._record(worker, EVENT_REFUSED,
                               f"failover of {worker} not done ({requested_by}): {exc}")
            raise
        await self._record(worker, EVENT_DONE, f"failover of {worker}: {active} active "
                           f"{seconds:.3f} s after the request ({requested_by})")
        return active, seconds

    async def _record(self, worker: str, kind: str, message: str) -> None:
        log.info("%s", message)
        now = time.time()
        event = Event(at=now, kind=kind, source=self._node, message=message)
        try:
            await self._store.txn([], [
                Delete(self._keys.intent("failover", worker)),
                Put(self._keys.event(int(now * 1000), self._node, 0), encode_value(event)),
            ])
        except StoreError as exc:
            log.warning("could not record the failover of %s: %s", worker, exc)


def drain_intent(view: ClusterView, worker: WorkerRecord) -> Intent | None:
    """The drain intent naming the worker or its node (the worker's own first), if any."""
    intents = [i for i in view.intents_for(worker) if i.kind == "drain"]
    return min(intents, key=lambda i: i.target_kind != "worker", default=None)


def in_flight(worker: WorkerRecord) -> int:
    return worker.load.running + worker.load.waiting


class DrainStates:
    """A drained worker's published state: `draining` with requests in flight, `drained`
    without. Only a worker that would otherwise be published as serving changes (one that
    is starting, recovering or failed says so instead)."""

    def __init__(self, node: str, store: Store, keys: Keys,
                 view: Callable[[], ClusterView | None],
                 workers: Callable[[], list[WorkerRecord]]) -> None:
        self._node = node
        self._store = store
        self._keys = keys
        self._view = view
        self._workers = workers
        # Intents whose worker was recorded empty, by (worker, requested_at): once each.
        self._recorded: set[tuple[str, float]] = set()
        self._seq = 0

    def decorate(self, record: WorkerRecord) -> WorkerRecord:
        view = self._view()
        if view is None or record.state not in ("serving", "draining"):
            return record
        if drain_intent(view, record) is None:
            return record
        state = "draining" if in_flight(record) else "drained"
        return msgspec.structs.replace(record, state=state)

    async def run(self, stop: asyncio.Event, every_s: float = 0.2) -> None:
        while not stop.is_set():
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
