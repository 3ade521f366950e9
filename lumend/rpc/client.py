"""Clients of the Coordinator and Agent services, returning the typed values of `messages`.

A failed call raises `RpcFailure` with the gRPC status code's name and the server's message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from lumend.rpc import lumen_pb2 as pb
from lumend.rpc import lumen_pb2_grpc as stubs
from lumend.rpc.messages import (
    Admission,
    CheckpointProgress,
    NodeStatus,
    RecoverAsk,
    Recovery,
)
from lumend.rpc.tls import RpcTls, open_channel

# How long one Progress write (or the stream's close) may wait for the coordinator.
PROGRESS_WRITE_DEADLINE_S = 2.0

# Codes after which another coordinator (or a later try) may answer.
RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN"})


class RpcFailure(Exception):
    def __init__(self, address: str, method: str, code: str, details: str) -> None:
        self.address, self.method, self.code, self.details = address, method, code, details
        super().__init__(f"{method} at {address}: {code}: {details}")

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE


async def _call(address: str, method: str, fn: Any, request: Any, timeout_s: float) -> Any:
    try:
        return await fn(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise RpcFailure(address, method, exc.code().name, exc.details() or "") from None


class CoordinatorClient:
    def __init__(self, address: str, tls: RpcTls | None = None) -> None:
        self.address = address
        self._channel = open_channel(address, tls)
        self._stub = stubs.CoordinatorStub(self._channel)

    async def admit(self, request_id: str, model: str | None, gateway: str,
                    exclude: Sequence[str] = (), timeout_s: float = 1.0) -> Admission:
        request = pb.AdmitRequest(request_id=request_id, model=model or "", gateway=gateway,
                                  exclude=list(exclude))
        reply = await _call(self.address, "Admit", self._stub.Admit, request, timeout_s)
        return Admission.from_pb(reply)

    async def admit_many(self, asks: Sequence[tuple[str, str | None, Sequence[str]]],
                         gateway: str, timeout_s: float = 1.0) -> list[Admission]:
        """Several admissions in one call, (request id, model, exclude) each, decided in
        order. Fewer answers than asks: the coordinator (an earlier release) decided the
        first only; the caller asks again for the rest."""
        requests = [pb.AdmitRequest(request_id=r, model=m or "", gateway=gateway,
                                    exclude=list(x)) for r, m, x in asks]
        first = requests[0]
        first.more.extend(requests[1:])
        reply = await _call(self.address, "Admit", self._stub.Admit, first, timeout_s)
        return [Admission.from_pb(reply), *map(Admission.from_pb, reply.more)]

    async def recover(self, ask: RecoverAsk, timeout_s: float = 1.0) -> Recovery:
        reply = await _call(self.address, "Recover", self._stub.Recover, ask.to_pb(), timeout_s)
        return Recovery.from_pb(reply)

    async def finish(self, request_id: str, timeout_s: float = 1.0) -> tuple[int, bool]:
        """(epoch, whether the coordinator knew the request)."""
        reply = await _call(self.address, "Finish", self._stub.Finish,
                            pb.FinishRequest(request_id=request_id), timeout_s)
        return reply.epoch, reply.known

    async def finish_many(self, request_ids: Sequence[str], timeout_s: float = 1.0
                          ) -> tuple[int, int]:
        """One batch of finished requests: (epoch, how many the coordinator knew)."""
        reply = await _call(self.address, "Finish", self._stub.Finish,
                            pb.FinishRequest(request_ids=list(request_ids)), timeout_s)
        return reply.epoch, reply.known_count

    def progress(self, write_deadline_s: float = PROGRESS_WRITE_DEADLINE_S) -> ProgressStream:
        return ProgressStream(self.address, self._stub.Progress(), write_deadline_s)

    async def close(self) -> None:
        await self._channel.close()


class ProgressStream:
    """One client-streamed Progress call: write reports, then `close` for the reply.

    Every write and the close have a deadline (issue 14 item 8): a coordinator that is
    paused or black-holed stops reading, its flow-control window fills, and an unbounded
    write would block the reporter forever, never moving to the next term. A write that
    misses its deadline cancels the call and raises DEADLINE_EXCEEDED; `keepalive` writes
    an empty report, so a stream with nothing to report still finds out."""

    def __init__(self, address: str, call: Any,
                 write_deadline_s: float = PROGRESS_WRITE_DEADLINE_S) -> None:
        self.address = address
        self._call = call
        self._deadline_s = write_deadline_s

    async def send(self, report: CheckpointProgress) -> None:
        await self._write(report.to_pb())

    async def keepalive(self) -> None:
        await self._write(pb.ProgressReport())

    async def _write(self, message: pb.ProgressReport) -> None:
        try:
            async with asyncio.timeout(self._deadline_s):
                await self._call.write(message)
        except TimeoutError:
            self._call.cancel()
            raise RpcFailure(self.address, "Progress", "DEADLINE_EXCEEDED",
                             f"a report was not taken within {self._deadline_s:g} s (the "
                             "coordinator is paused or unreachable)") from None
        except grpc.aio.AioRpcError as exc:
            raise RpcFailure(self.address, "Progress", exc.code().name,
                             exc.details() or "") from None
        except grpc.aio.UsageError as exc:  # the call already ended (the server went away)
            raise RpcFailure(self.address, "Progress", "UNAVAILABLE", str(exc)) from None

    async def close(self) -> tuple[int, int, int]:
        """(epoch, reports, unknown) as the coordinator counted them."""
        try:
            async with asyncio.timeout(self._deadline_s):
                await self._call.done_writing()
                reply = await self._call
        except TimeoutError:
            self._call.cancel()
            raise RpcFailure(self.address, "Progress", "DEADLINE_EXCEEDED",
                             f"no reply within {self._deadline_s:g} s") from None
        except grpc.aio.AioRpcError as exc:
            raise RpcFailure(self.address, "Progress", exc.code().name,
                             exc.details() or "") from None
        return reply.epoch, reply.reports, reply.unknown

    def cancel(self) -> None:
        self._call.cancel()


class AgentClient:
    def __init__(self, address: str, tls: RpcTls | None = None) -> None:
        self.address = address
        self._channel = open_channel(address, tls)
        self._stub = stubs.AgentStub(self._channel)

    async def status(self, timeout_s: float = 2.0) -> NodeStatus:
        reply = await _call(self.address, "Status", self._stub.Status, pb.StatusRequest(),
                            timeout_s)
        return NodeStatus.from_pb(reply)

    async def failover(self, epoch: int, worker: str, requested_at: float = 0.0,
                       timeout_s: float = 90.0) -> tuple[str, float]:
        """(the engine that took over, seconds it took). `requested_at` names the failover
        intent carried out (0: none)."""
        reply = await _call(self.address, "Failover", self._stub.Failover,
                            pb.FailoverRequest(epoch=epoch, worker=worker,
                                               requested_at=requested_at), timeout_s)
        return reply.active, reply.seconds

    async def drain(self, epoch: int, target: str, undo: bool = False,
                    timeout_s: float = 2.0) -> tuple[list[str], int]:
        """(the node's drained workers, requests still running on them)."""
        reply = await _call(self.address, "Drain", self._stub.Drain,
                            pb.DrainRequest(epoch=epoch, target=target, undo=undo), timeout_s)
        return list(reply.drained), reply.in_flight

    async def close(self) -> None:
        await self._channel.close()
