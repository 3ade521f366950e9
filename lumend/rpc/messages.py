"""Typed values of the control plane, and their conversion to and from lumen.v1 messages.

Code outside lumend/rpc sees these dataclasses only, never the generated classes.
"""

from __future__ import annotations

from dataclasses import dataclass

from lumend.rpc import lumen_pb2 as pb


@dataclass(frozen=True)
class Target:
    """A worker to send a request to, with its engine URLs (the active engine first)."""

    worker: str
    node: str
    model: str
    urls: tuple[str, ...]

    def to_pb(self) -> pb.Target:
        return pb.Target(worker=self.worker, node=self.node, model=self.model,
                         urls=list(self.urls))

    @classmethod
    def from_pb(cls, m: pb.Target) -> Target:
        return cls(m.worker, m.node, m.model, tuple(m.urls))


@dataclass(frozen=True)
class CheckpointRef:
    """Where a request's KV pages are checkpointed: the holder worker and its node's holder."""

    ckpt_id: str
    holder: str
    endpoint: str

    def to_pb(self) -> pb.Checkpoint:
        return pb.Checkpoint(ckpt_id=self.ckpt_id, holder=self.holder, endpoint=self.endpoint)

    @classmethod
    def from_pb(cls, m: pb.Checkpoint) -> CheckpointRef | None:
        return cls(m.ckpt_id, m.holder, m.endpoint) if m.ckpt_id else None


@dataclass(frozen=True)
class Admission:
    epoch: int
    target: Target | None  # None: no worker can take the request now
    checkpoint: CheckpointRef | None
    reason: str
    policy: str

    def to_pb(self) -> pb.AdmitReply:
        reply = pb.AdmitReply(epoch=self.epoch, admitted=self.target is not None,
                              reason=self.reason, policy=self.policy)
        if self.target is not None:
            reply.target.CopyFrom(self.target.to_pb())
        if self.checkpoint is not None:
            reply.checkpoint.CopyFrom(self.checkpoint.to_pb())
        return reply

    @classmethod
    def from_pb(cls, m: pb.AdmitReply) -> Admission:
        return cls(m.epoch, Target.from_pb(m.target) if m.admitted else None,
                   CheckpointRef.from_pb(m.checkpoint) if m.HasField("checkpoint") else None,
                   m.reason, m.policy)


@dataclass(frozen=True)
class Recovery:
    epoch: int
    target: Target | None  # None: no survivor can take the request now
    resume: bool  # resume from the checkpoint on the target (else recompute there)
    reason: str
    policy: str

    def to_pb(self) -> pb.RecoverReply:
        reply = pb.RecoverReply(epoch=self.epoch, routed=self.target is not None,
                                resume=self.resume, reason=self.reason, policy=self.policy)
        if self.target is not None:
            reply.target.CopyFrom(self.target.to_pb())
        return reply

    @classmethod
    def from_pb(cls, m: pb.RecoverReply) -> Recovery:
        return cls(m.epoch, Target.from_pb(m.target) if m.routed else None, m.resume,
                   m.reason, m.policy)


@dataclass(frozen=True)
class RecoverAsk:
    """What a gateway knows about an interrupted request (it outlives coordinators)."""

    request_id: str
    failed_worker: str
    prefix_tokens: int
    model: str
    checkpoint: CheckpointRef | None
    gateway: str

    def to_pb(self) -> pb.RecoverRequest:
        m = pb.RecoverRequest(request_id=self.request_id, failed_worker=self.failed_worker,
                              prefix_tokens=self.prefix_tokens, model=self.model,
                              gateway=self.gateway)
        if self.checkpoint is not None:
            m.checkpoint.CopyFrom(self.checkpoint.to_pb())
        return m

    @classmethod
    def from_pb(cls, m: pb.RecoverRequest) -> RecoverAsk:
        ckpt = CheckpointRef.from_pb(m.checkpoint) if m.HasField("checkpoint") else None
        return cls(m.request_id, m.failed_worker, m.prefix_tokens, m.model, ckpt, m.gateway)


@dataclass(frozen=True)
class CheckpointProgress:
    ckpt_id: str
    holder: str
    bytes: int  # 0: gone
    tokens: int

    def to_pb(self) -> pb.ProgressReport:
        return pb.ProgressReport(ckpt_id=self.ckpt_id, holder=self.holder, bytes=self.bytes,
                                 tokens=self.tokens)

    @classmethod
    def from_pb(cls, m: pb.ProgressReport) -> CheckpointProgress:
        return cls(m.ckpt_id, m.holder, m.bytes, m.tokens)


@dataclass(frozen=True)
class EngineStatus:
    id: str
    role: str
    state: str
    url: str
    pid: int


@dataclass(frozen=True)
class WorkerStatus:
    name: str
    state: str
    model: str
    drained: bool
    running: int
    waiting: int
    engines: tuple[EngineStatus, ...]


@dataclass(frozen=True)
class NodeStatus:
    node: str
    highest_epoch: int
    status: str
    workers: tuple[WorkerStatus, ...]
    stale_refused: int

    def to_pb(self) -> pb.StatusReply:
        return pb.StatusReply(
            node=self.node, highest_epoch=self.highest_epoch, status=self.status,
            stale_refused=self.stale_refused,
            workers=[pb.Worker(name=w.name, state=w.state, model=w.model, drained=w.drained,
                               running=w.running, waiting=w.waiting,
                               engines=[pb.Engine(id=e.id, role=e.role, state=e.state,
                                                  url=e.url, pid=e.pid) for e in w.engines])
                     for w in self.workers])

    @classmethod
    def from_pb(cls, m: pb.StatusReply) -> NodeStatus:
        return cls(m.node, m.highest_epoch, m.status, tuple(
            WorkerStatus(w.name, w.state, w.model, w.drained, w.running, w.waiting,
                         tuple(EngineStatus(e.id, e.role, e.state, e.url, e.pid)
                               for e in w.engines))
            for w in m.workers), m.stale_refused)
