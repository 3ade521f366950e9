"""The Agent service every lumend serves: Status, Failover and Drain for this node's workers.

Commands (Failover, Drain) come from a coordinator, which sends them for the intents in its
snapshot (lumend/coordinator/commands.py), and carry its epoch. The node's `EpochFence`
(fed from every etcd snapshot by the HA loop) refuses an epoch lower than the highest seen
(the sender is a deposed coordinator) and one higher than seen unless etcd confirms it is
the coordinator key's create revision (nobody elected sent it; the bar stays). Refusals are
counted and logged. A failover is carried out only for a pending intent it claims
(lumend/failover/intents.py): an order without one (`requested_at` 0) does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from lumend.cluster.fencing import EpochFence, StaleEpochError, UnknownEpochError
from lumend.cluster.models import WorkerRecord
from lumend.cluster.store import StoreError
from lumend.failover.intents import FailoverFailed, IntentGone
from lumend.rpc import lumen_pb2 as pb
from lumend.rpc.messages import EngineStatus, NodeStatus, WorkerStatus

log = logging.getLogger("lumend.rpc")


class CommandRefused(Exception):
    def __init__(self, code: Any, message: str) -> None:
        super().__init__(message)
        self.code = code


# Carries out a failover: (worker, the intent's requested_at or 0 for none, who ordered it)
# -> (the engine now active, seconds). FailoverIntents.carry_out on a node.
FailoverFn = Callable[[str, float, str], Awaitable[tuple[str, float]]]


class AgentService:
    def __init__(self, node: str, fence: EpochFence,
                 workers: Callable[[], Sequence[WorkerRecord]],
                 status: Callable[[], str],
                 failover: FailoverFn,
                 drained: set[str] | None = None) -> None:
        self.node = node
        self.fence = fence
        self._workers = workers
        self._status = status
        self._failover = failover
        # The workers the coordinator has drained; shared with the node's DrainStates,
        # which publishes them as draining/drained.
        self.drained: set[str] = drained if drained is not None else set()
        self.stale_refused = 0  # epochs below the highest seen
        self.unknown_refused = 0  # epochs above it that etcd did not confirm
        self.commands: dict[str, int] = {"failover": 0, "drain": 0}

    def admit_epoch(self, command: str, epoch: int) -> None:
        """Raise CommandRefused unless `epoch` is the highest epoch seen (fencing by what
        has been seen alone; `verify_epoch` also confirms a higher one in etcd)."""
        self._signed(command, epoch)
        try:
            self.fence.check(epoch)
        except StaleEpochError as exc:
            self._refused(command, exc)

    async def verify_epoch(self, command: str, epoch: int) -> None:
        """Raise CommandRefused unless `epoch` is the current coordinator's: the highest
        seen, or a higher one that etcd confirms (which then becomes the highest)."""
        self._signed(command, epoch)
        try:
            await self.fence.admit(epoch)
        except StaleEpochError as exc:
            self._refused(command, exc)
        except StoreError as exc:
            raise CommandRefused(grpc.StatusCode.UNAVAILABLE,
                                 f"{command} from epoch {epoch} not checked: etcd could not "
                                 f"confirm the coordinator's epoch ({exc}); retry") from None

    @staticmethod
    def _signed(command: str, epoch: int) -> None:
        if epoch <= 0:
            raise CommandRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"{command} needs the epoch of the coordinator that sends it "
                                 "(epoch > 0)")

    def _refused(self, command: str, exc: StaleEpochError) -> None:
        if isinstance(exc, UnknownEpochError):
            self.unknown_refused += 1
        else:
            self.stale_refused += 1
        log.warning("%s on %s: %s", command, self.node, exc)
        raise CommandRefused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None

    def status(self) -> NodeStatus:
        workers = tuple(
            WorkerStatus(w.name, w.state, w.model, w.name in self.drained, w.load.running,
                         w.load.waiting,
                         tuple(EngineStatus(e.id, e.role, e.state, e.url, e.pid or 0)
                               for e in w.engines))
            for w in self._workers())
        return NodeStatus(self.node, self.fence.highest, self._status(), workers,
                          self.stale_refused)

    async def failover(self, epoch: int, worker: str,
                       requested_at: float = 0.0) -> tuple[str, float]:
        await self.verify_epoch("Failover", epoch)
        if worker not in {w.name for w in self._workers()}:
            raise CommandRefused(grpc.StatusCode.NOT_FOUND,
                                 f"no worker {worker!r} on node {self.node}")
        log.info("Failover of %s ordered by coordinator epoch %d (epoch checked)", worker,
                 epoch)
        try:
            outcome = await self._failover(worker, requested_at,
                                           f"ordered by coordinator epoch {epoch}")
        except IntentGone as exc:
            raise CommandRefused(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        except StoreError as exc:
            raise CommandRefused(grpc.StatusCode.UNAVAILABLE,
                                 f"failover of {worker} not started: etcd: {exc}") from None
        except (FailoverFailed, RuntimeError, TimeoutError) as exc:
            raise CommandRefused(grpc.StatusCode.ABORTED,
                                 f"failover of {worker} not done: {exc}") from None
        self.commands["failover"] += 1
        return outcome

    async def drain_command(self, epoch: int, target: str,
                            undo: bool) -> tuple[list[str], int]:
        """`drain` for a command from the network: a higher epoch is confirmed first."""
        await self.verify_epoch("Drain", epoch)
        return self.drain(epoch, target, undo)

    def drain(self, epoch: int, target: str, undo: bool) -> tuple[list[str], int]:
        self.admit_epoch("Drain", epoch)
        workers = {w.name: w for w in self._workers()}
        if target == self.node:
            names = set(workers)
        elif target in workers:
            names = {target}
        else:
            raise CommandRefused(grpc.StatusCode.NOT_FOUND,
                                 f"{target!r} is neither node {self.node} nor one of its "
                                 f"workers ({', '.join(sorted(workers)) or 'none'})")
        self.commands["drain"] += 1
        if undo:
            self.drained -= names
        else:
            self.drained |= names
        log.info("%s %s (coordinator epoch %d)", "undrained" if undo else "drained",
                 ", ".join(sorted(names)), epoch)
        in_flight = sum(workers[n].load.running + workers[n].load.waiting
                        for n in self.drained if n in workers)
        return sorted(self.drained), in_flight


class AgentServicer:
    """gRPC glue: lumen.v1.Agent onto AgentService."""

    def __init__(self, service: AgentService) -> None:
        self.service = service

    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusReply:
        return self.service.status().to_pb()

    async def Failover(self, request: pb.FailoverRequest, context: Any) -> pb.FailoverReply:
        try:
            active, seconds = await self.service.failover(request.epoch, request.worker,
                                                          request.requested_at)
        except CommandRefused as exc:
            await context.abort(exc.code, str(exc))
        return pb.FailoverReply(epoch=request.epoch, active=active, seconds=seconds)

    async def Drain(self, request: pb.DrainRequest, context: Any) -> pb.DrainReply:
        try:
            drained, in_flight = await self.service.drain_command(request.epoch, request.target,
                                                                  request.undo)
        except CommandRefused as exc:
            await context.abort(exc.code, str(exc))
        return pb.DrainReply(epoch=request.epoch, drained=drained, in_flight=in_flight)
