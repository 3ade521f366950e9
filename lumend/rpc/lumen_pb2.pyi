from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Target(_message.Message):
    __slots__ = ("worker", "node", "model", "urls")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    URLS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    node: str
    model: str
    urls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker: _Optional[str] = ..., node: _Optional[str] = ..., model: _Optional[str] = ..., urls: _Optional[_Iterable[str]] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("ckpt_id", "holder", "endpoint")
    CKPT_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ckpt_id: str
    holder: str
    endpoint: str
    def __init__(self, ckpt_id: _Optional[str] = ..., holder: _Optional[str] = ..., endpoint: _Optional[str] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "model", "gateway", "exclude", "more")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    gateway: str
    exclude: _containers.RepeatedScalarFieldContainer[str]
    more: _containers.RepeatedCompositeFieldContainer[AdmitRequest]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., gateway: _Optional[str] = ..., exclude: _Optional[_Iterable[str]] = ..., more: _Optional[_Iterable[_Union[AdmitRequest, _Mapping]]] = ...) -> None: ...

class AdmitReply(_message.Message):
    __slots__ = ("epoch", "admitted", "target", "checkpoint", "reason", "policy", "more")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    admitted: bool
    target: Target
    checkpoint: Checkpoint
    reason: str
    policy: str
    more: _containers.RepeatedCompositeFieldContainer[AdmitReply]
    def __init__(self, epoch: _Optional[int] = ..., admitted: _Optional[bool] = ..., target: _Optional[_Union[Target, _Mapping]] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., reason: _Optional[str] = ..., policy: _Optional[str] = ..., more: _Optional[_Iterable[_Union[AdmitReply, _Mapping]]] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("request_id", "request_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FinishReply(_message.Message):
    __slots__ = ("epoch", "known", "known_count")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    KNOWN_COUNT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    known: bool
    known_count: int
    def __init__(self, epoch: _Optional[int] = ..., known: _Optional[bool] = ..., known_count: _Optional[int] = ...) -> None: ...

class RecoverRequest(_message.Message):
    __slots__ = ("request_id", "failed_worker", "prefix_tokens", "model", "checkpoint", "gateway")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    failed_worker: str
    prefix_tokens: int
    model: str
    checkpoint: Checkpoint
    gateway: str
    def __init__(self, request_id: _Optional[str] = ..., failed_worker: _Optional[str] = ..., prefix_tokens: _Optional[int] = ..., model: _Optional[str] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., gateway: _Optional[str] = ...) -> None: ...

class RecoverReply(_message.Message):
    __slots__ = ("epoch", "routed", "target", "resume", "reason", "policy")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    routed: bool
    target: Target
    resume: bool
    reason: str
    policy: str
    def __init__(self, epoch: _Optional[int] = ..., routed: _Optional[bool] = ..., target: _Optional[_Union[Target, _Mapping]] = ..., resume: _Optional[bool] = ..., reason: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class ProgressReport(_message.Message):
    __slots__ = ("ckpt_id", "holder", "bytes", "tokens")
    CKPT_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ckpt_id: str
    holder: str
    bytes: int
    tokens: int
    def __init__(self, ckpt_id: _Optional[str] = ..., holder: _Optional[str] = ..., bytes: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class ProgressReply(_message.Message):
    __slots__ = ("epoch", "reports", "unknown")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    reports: int
    unknown: int
    def __init__(self, epoch: _Optional[int] = ..., reports: _Optional[int] = ..., unknown: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Engine(_message.Message):
    __slots__ = ("id", "role", "state", "url", "pid")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: str
    state: str
    url: str
    pid: int
    def __init__(self, id: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., url: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("name", "state", "model", "drained", "running", "waiting", "engines")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    model: str
    drained: bool
    running: int
    waiting: int
    engines: _containers.RepeatedCompositeFieldContainer[Engine]
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., model: _Optional[str] = ..., drained: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[Engine, _Mapping]]] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("node", "highest_epoch", "status", "workers", "stale_refused")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    STALE_REFUSED_FIELD_NUMBER: _ClassVar[int]
    node: str
    highest_epoch: int
    status: str
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    stale_refused: int
    def __init__(self, node: _Optional[str] = ..., highest_epoch: _Optional[int] = ..., status: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., stale_refused: _Optional[int] = ...) -> None: ...

class FailoverRequest(_message.Message):
    __slots__ = ("epoch", "worker", "requested_at")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_AT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    worker: str
    requested_at: float
    def __init__(self, epoch: _Optional[int] = ..., worker: _Optional[str] = ..., requested_at: _Optional[float] = ...) -> None: ...

class FailoverReply(_message.Message):
    __slots__ = ("epoch", "active", "seconds")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    active: str
    seconds: float
    def __init__(self, epoch: _Optional[int] = ..., active: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("epoch", "target", "undo")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    UNDO_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    target: str
    undo: bool
    def __init__(self, epoch: _Optional[int] = ..., target: _Optional[str] = ..., undo: _Optional[bool] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("epoch", "drained", "in_flight")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    drained: _containers.RepeatedScalarFieldContainer[str]
    in_flight: int
    def __init__(self, epoch: _Optional[int] = ..., drained: _Optional[_Iterable[str]] = ..., in_flight: _Optional[int] = ...) -> None: ...
