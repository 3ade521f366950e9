"""The coordinator's orders to the nodes: the intents of each HA cycle's snapshot become
Agent `Failover` and `Drain` calls to the worker's node, carrying the coordinator's epoch.

Decided from the snapshot alone, Patroni-style: a pending failover intent is ordered once
per term (again after a retryable failure, every `retry_s`); a worker under a drain intent
that its node still publishes as serving is told to drain, one published as draining or
drained without an intent is told to undo it. The node fences each order by epoch and
carries out a failover intent at most once (it claims the intent in etcd first), so an
order repeated by this or the next coordinator does nothing twice.

Calls run as tasks off the HA loop (a switchover can take a minute); a coordinator that
steps down cancels its calls, which the nodes finish anyway.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from lumend.cluster.models import WorkerRecord
from lumend.cluster.store import Op
from lumend.cluster.view import ClusterView
from lumend.rpc.client import AgentClient, RpcFailure
from lumend.rpc.tls import RpcTls

log = logging.getLogger("lumend.coordinator")

PUBLISHED_DRAINED = ("draining", "drained")


class AgentCommands:
    def __init__(self, tls: RpcTls | None, retry_s: float = 2.0,
                 failover_timeout_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._tls = tls
        self._retry_s = retry_s
        self._failover_timeout_s = failover_timeout_s
        self._clock = clock
        self._epoch: int | None = None
        self._clients: dict[str, AgentClient] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Failover intents of this term by (worker, requested_at): when they may be ordered
        # again (inf: in flight or settled).
        self._failovers: dict[tuple[str, float], float] = {}
        # Drain orders of this term by worker: (drain or undo, when last sent).
        self._drains: dict[str, tuple[bool, float]] = {}
        # Orders sent and how they ended, by (command, outcome): for metrics and tests.
        self.orders: Counter[tuple[str, str]] = Counter()

    # -- the HA loop's hooks ------------------------------------------------------------

    def duty(self, view: ClusterView, epoch: int) -> list[Op]:
        """A coordinator duty (ClusterAgent.lead_duties): send the orders this snapshot
        calls for. Writes nothing itself: the nodes record the outcomes."""
        if epoch != self._epoch:
            self._end_term()
            self._epoch = epoch
        self._order_failovers(view, epoch)
        self._order_drains(view, epoch)
        return []

    def role_changed(self, epoch: int | None) -> None:
        if epoch is None:
            self._end_term()

    def _end_term(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        for client in self._clients.values():
            self._spawn(client.close())
        self._clients.clear()
        self._failovers.clear()
        self._drains.clear()
        self._epoch = None

    # -- decisions ----------------------------------------------------------------------

    def _order_failovers(self, view: ClusterView, epoch: int) -> None:
        now = self._clock()
        pending = {(i.target, i.requested_at): i for i in view.intents if i.kind == "failover"}
        for gone in set(self._failovers) - set(pending):
            del self._failovers[gone]
        for identity, intent in pending.items():
            if self._failovers.get(identity, -math.inf) > now:
                continue
            worker = view.workers.get(intent.target)
            address = self._address(view, worker)
            if worker is None or address is None:
                # Its node is not registered (down, restarting): ask again later; the
                # intent waits in etcd for it.
                self._failovers[identity] = now + self._retry_s
                continue
            self._failovers[identity] = math.inf
            self._spawn(self._failover(address, worker.node, epoch, intent.target,
                                       intent.requested_at, intent.requested_by))

    def _order_drains(self, view: ClusterView, epoch: int) -> None:
        now = self._clock()
        for worker in view.workers.values():
            wanted = any(i.kind == "drain" for i in view.intents_for(worker))
            if wanted and worker.state == "serving":
                drain = True
            elif not wanted and worker.state in PUBLISHED_DRAINED:
                drain = False
            else:  # as it should be, or in a state that drain does not change
                self._drains.pop(worker.name, None)
                continue
            address = self._address(view, worker)
            if address is None:
                continue
            last = self._drains.get(worker.name)
            # The node publishes the new state on its next cycle: until then the snapshot
            # still shows the old one, so an order is repeated only after `retry_s`.
            if last is not None and last[0] == drain and now - last[1] < self._retry_s:
                continue
            self._drains[worker.name] = (drain, now)
            self._spawn(self._drain(address, worker.node, epoch, worker.name, drain))

    @staticmethod
    def _address(view: ClusterView, worker: WorkerRecord | None) -> str | None:
        node = view.nodes.get(worker.node) if worker is not None else None
        return node.rpc if node is not None and node.state == "up" else None

    # -- calls --------------------------------------------------------------------------

    def _client(self, address: str) -> AgentClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = AgentClient(address, self._tls)
        return client

    def _spawn(self, call: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(call)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _failover(self, address: str, node: str, epoch: int, worker: str,
                        requested_at: float, requested_by: str) -> None:
        identity = (worker, requested_at)
        try:
            active, seconds = await self._client(address).failover(
                epoch, worker, requested_at, timeout_s=self._failover_timeout_s)
        except RpcFailure as exc:
            if exc.retryable:
                self.orders["failover", "retry"] += 1
                self._failovers[identity] = self._clock() + self._retry_s
                log.warning("Failover of %s (intent of %s) not taken by %s at %s: %s: %s; "
                            "ordering it again in %.0f s", worker, requested_by, node, address,
                            exc.code, exc.details, self._retry_s)
                return
            self.orders["failover", exc.code.lower()] += 1
            log.warning("Failover of %s (intent of %s) ended on %s: %s: %s", worker,
                        requested_by, node, exc.code, exc.details)
            return
        self.orders["failover", "done"] += 1
        log.info("ordered %s to fail over %s (intent of %s, epoch %d): %s active after "
                 "%.3f s", node, worker, requested_by, epoch, active, seconds)

    async def _drain(self, address: str, node: str, epoch: int, worker: str,
                     drain: bool) -> None:
        command = "drain" if drain else "undrain"
        try:
            await self._client(address).drain(epoch, worker, undo=not drain)
        except RpcFailure as exc:
            self.orders[command, "retry" if exc.retryable else exc.code.lower()] += 1
            log.warning("could not %s %s on %s at %s: %s: %s", command, worker, node, address,
                        exc.code, exc.details)
            return
        self.orders[command, "done"] += 1
        log.info("ordered %s to %s %s (epoch %d)", node, command, worker, epoch)
