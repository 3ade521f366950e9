"""The node's gRPC server on `[rpc] listen`: the Agent service always, the Coordinator
service answering only while this node holds the coordinator key.

Both services share one port, the one published in the node record and, while coordinator,
in the `coordinator` key; so the coordinator is found by reading that key. A node that is
not (or no longer) coordinator answers UNAVAILABLE naming the coordinator it follows, so a
gateway retries against the right one.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc

from lumend.cluster.lease import keeper_of
from lumend.config import parse_listen
from lumend.coordinator.service import CoordinatorService, NotReady
from lumend.rpc import lumen_pb2 as pb
from lumend.rpc import lumen_pb2_grpc as stubs
from lumend.rpc.agent_service import AgentService, AgentServicer
from lumend.rpc.messages import CheckpointProgress, RecoverAsk
from lumend.rpc.tls import RpcTls

log = logging.getLogger("lumend.rpc")


class RpcBindError(Exception):
    """The rpc listen address cannot be bound; the message names the key and the fix."""


def lease_confidence(service: CoordinatorService) -> str | None:
    """Why the lease of `service`'s term is not confidently held now (None: it is).

    Asked on every call, not once per HA cycle: a cycle can sit in one store call retried
    for longer than the lease's TTL minus its margin, and a process resumed after SIGSTOP
    (or a host after suspend) runs the calls queued meanwhile before its HA loop looks
    again. The lease's clock counts suspend (lumend.cluster.lease.boottime)."""
    keeper = keeper_of(service.term_lease())
    if keeper is None:
        return "this node holds no lease for the term"
    if not keeper.confident():
        return (f"lease not renewed for {keeper.seconds_since_renewal():.1f} s (limit "
                f"{keeper.confident_for_s:.1f} s)")
    return None


class CoordinatorServicer:
    """gRPC glue: lumen.v1.Coordinator onto the node's CoordinatorService, if it has one.

    Every call is answered only while the term's lease is confidently held (`confidence`,
    by default `lease_confidence`); otherwise UNAVAILABLE, counted in `refused` and in the
    term's `lumen_coordinator_decisions{kind="refused_lease"}`."""

    def __init__(self, current: Callable[[], CoordinatorService | None],
                 following: Callable[[], str],
                 confidence: Callable[[CoordinatorService], str | None] = lease_confidence
                 ) -> None:
        self._current = current
        self._following = following
        self._confidence = confidence
        self.refused: Counter[str] = Counter()  # calls refused, by why: lease, not_coordinator

    async def _service(self, context: Any) -> CoordinatorService:
        service = self._current()
        if service is None:
            self.refused["not_coordinator"] += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"not the coordinator: {self._following()}")
        assert service is not None
        why = self._confidence(service)
        if why is not None:
            self.refused["lease"] += 1
            service.decisions["refused_lease"] += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"coordinator epoch {service.epoch} is not sure of its lease "
                                f"({why}); retry against the coordinator etcd names")
        return service

    async def Admit(self, request: pb.AdmitRequest, context: Any) -> pb.AdmitReply:
        service = await self._service(context)
        try:
            reply = service.admit(request.request_id, request.model, request.gateway,
                                  list(request.exclude)).to_pb()
            # A gateway's batch (issue 16): decided in order, as that many single calls.
            for more in request.more:
                reply.more.append(service.admit(more.request_id, more.model, more.gateway,
                                                list(more.exclude)).to_pb())
        except NotReady as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return reply

    async def Finish(self, request: pb.FinishRequest, context: Any) -> pb.FinishReply:
        service = await self._service(context)
        known = service.finish(request.request_id) if request.request_id else False
        batch = service.finish_many(request.request_ids) if request.request_ids else 0
        return pb.FinishReply(epoch=service.epoch, known=known, known_count=known + batch)

    async def Recover(self, request: pb.RecoverRequest, context: Any) -> pb.RecoverReply:
        service = await self._service(context)
        if not request.request_id or not request.failed_worker:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "Recover needs request_id and failed_worker")
        try:
            recovery = service.recover(RecoverAsk.from_pb(request))
        except NotReady as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return recovery.to_pb()

    async def Progress(self, requests: Any, context: Any) -> pb.ProgressReply:
        service = await self._service(context)
        reports = unknown = 0
        async for report in requests:
            if self._current() is not service:  # stepped down mid-stream: send them on
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"no longer the coordinator: {self._following()}")
            if not report.ckpt_id and not report.holder:
                continue  # a keepalive (lumend.rpc.client.ProgressStream)
            if not report.ckpt_id or not report.holder:
                unknown += 1
                continue
            reports += 1
            if not service.progress(CheckpointProgress.from_pb(report)):
                unknown += 1
        return pb.ProgressReply(epoch=service.epoch, reports=reports, unknown=unknown)


class RpcServer:
    def __init__(self, agent: AgentService, coordinator: CoordinatorServicer,
                 tls: RpcTls | None = None) -> None:
        self.agent = agent
        self._coordinator = coordinator
        self._tls = tls
        self._server: Any = None
        self.port = 0

    async def start(self, listen: str) -> None:
        host, port = parse_listen(listen)
        server = grpc.aio.server()
        stubs.add_AgentServicer_to_server(AgentServicer(self.agent), server)
        stubs.add_CoordinatorServicer_to_server(self._coordinator, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if self._tls is None:
                bound = server.add_insecure_port(address)
            else:
                bound = server.add_secure_port(address, self._tls.server_credentials())
        except RuntimeError as exc:
            bound, error = 0, str(exc)
        else:
            error = "the address is in use or not on this host"
        if not bound:
            raise RpcBindError(f'rpc.listen = "{listen}": cannot listen there ({error}); '
                               "choose a free port or an address of this host")
        await server.start()
        self._server = server
        self.port = bound
        log.info("gRPC (Agent, Coordinator) on %s, %s", address,
                 "mTLS" if self._tls else "plaintext")

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
