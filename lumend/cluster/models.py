"""Typed values of the etcd keys (JSON, readable with etcdctl).

Values are decoded at the edge (`decode_value`); a malformed or foreign value is reported
by the caller and skipped, never trusted.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec

WorkerState = Literal[
    "starting", "serving", "recovering", "assisting", "draining", "drained", "failed", "stopped"
]
NodeState = Literal["up", "stopping"]


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    role: Literal["active", "shadow"]
    state: str
    url: str
    pid: int | None = None


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    # Checkpoint coverage as the active engine reports it: running requests, and those with
    # a complete checkpoint. None: the engine does not say (coverage unknown, not 0).
    ckpt_running: int | None = None
    ckpt_complete: int | None = None
    # Cost counters of the active engine since it started (cumulative; they go back to 0
    # when it restarts), exact. None: the engine does not export them. The coordinator
    # turns them into its cost estimates (lumend.coordinator.estimates): checkpoint bytes
    # restored and the seconds those restores took (and the tokens whose KV they held);
    # prompt tokens prefilled and the seconds prefills took. A change of the counters alone
    # is written at most every COUNTER_REFRESH_S (lumend.cluster.agent), not per heartbeat.
    restored_bytes: int | None = None
    restored_tokens: int | None = None
    restore_s: float | None = None
    prefill_tokens: int | None = None
    prefill_s: float | None = None
    # Step counters, for draft-assist's predicted gain (lumend.coordinator.estimates
    # .StepTracker): seconds of the engine's steps as its decoding requests saw them, and
    # how many (vLLM: the inter-token latency histogram's sum and count, one per request
    # per step; the sim engine: its modelled steps). Exact, as the counters above: a recent
    # step time is their growth between two records some seconds apart, after a month of
    # an engine's life as after a minute.
    step_s: float | None = None
    steps: int | None = None
    # The step-cost fit's sums (lumend.engine.step_fit.FIT_KEYS: steps, extra tokens,
    # sequences, seconds and their products), cumulative as the counters above: the
    # coordinator fits the marginal seconds of a prompt token from them. None: not exported.
    step_fit: list[float] | None = None


class CheckpointUsage(msgspec.Struct, frozen=True, kw_only=True):
    bytes_held: int = 0
    budget_bytes: int = 0
    requests: int = 0


class NodeRecord(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    address: str
    state: NodeState = "up"
    pid: int
    version: str
    started_at: float
    updated_at: float
    gateway: str
    rpc: str
    checkpoint: str
    metrics: str
    workers: list[str] = []
    status: str = ""


class AssistUsage(msgspec.Struct, frozen=True, kw_only=True):
    """A survivor's draft-assist as its engine counts it (draft-assist, Algorithm 3)."""

    assignment: str  # the assignment's id (the `assist/<worker>` key's `id`)
    drafter: str  # the recovering worker whose drafts it verifies
    drafted_tokens: int = 0
    accepted_tokens: int = 0


class WorkerRecord(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    node: str
    gpus: list[int]
    engine: str
    model: str  # the name it serves under (its first --served-model-name, else its model)
    state: WorkerState
    # Its other served names (--served-model-name's after the first): routed to it as well,
    # as the model it is, and listed in /v1/models.
    aliases: list[str] = []
    engines: list[EngineInfo] = []
    load: WorkerLoad = WorkerLoad()
    checkpoints: CheckpointUsage = CheckpointUsage()
    updated_at: float
    draft: str = ""  # while assisting: its draft server (tcp://host:port)
    assist: AssistUsage | None = None  # while a drafter assists this worker
    # Why its active engine is taken as stalled (a missed probe, a silent engine core),
    # "" while it answers: serving still (its streams wait for it), but new requests,
    # checkpoints and interrupted requests go elsewhere while another worker can take them.
    stalled: str = ""


class CoordinatorRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Value of the `coordinator` key. The epoch is the key's create revision, not a field:
    etcd assigns it, so no writer can claim one it did not win."""

    node: str
    address: str
    rpc: str
    elected_at: float


class CoordinatorStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What the coordinator last decided, written by it (epoch-guarded) every cycle."""

    node: str
    epoch: int
    at: float
    decision: str
    members: list[str] = []


class Intent(msgspec.Struct, frozen=True, kw_only=True):
    kind: Literal["drain", "failover"]
    target: str
    target_kind: Literal["node", "worker"]
    requested_at: float
    requested_by: str
    reason: str = ""
    migrate: bool = False


PolicyMode = Literal["lumen", "fixed_checkpoint", "stop_and_restart"]
# How decisions are made (lumend.coordinator.settings): in seconds from the cost model, with
# admission to the shortest queue (the default), or the paper's Algorithms 1-3 as published.
Decisions = Literal["cost_aware", "paper"]
# Where cost-aware decisions take their cost figures (lumend.coordinator.estimates): measured
# by the engines where they are (the default), or PolicyConfig's constants only.
Costs = Literal["measured", "constant"]
AssistObjective = Literal["ttft", "throughput"]


class ClusterSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                      omit_defaults=True):
    """Value of the `config` key: the policy tunables (DESIGN.md section 5), read by the
    coordinator every cycle and set with `lumenctl config set`. Checked by
    lumend.coordinator.settings; absent fields take these defaults. Defaults are not
    written (`omit_defaults`): a node of an older release, which refuses fields it does not
    know, still reads a value that only sets what it knows."""

    alpha: float = 1.0 / (1 << 30)  # L_hat weight of one checkpoint byte held
    beta: float = 1.0  # L_hat weight of one queued request
    theta: float = 48.0  # a holder above this L_hat is overloaded for resumption
    tau: int = 64  # a checkpointed prefix longer than this many blocks resumes regardless
    mode: PolicyMode = "lumen"
    # cost_aware: alpha, beta, theta and tau are not used (the cost model's seconds instead).
    decisions: Decisions = "cost_aware"
    costs: Costs = "measured"
    # What draft-assist's predicted gain weighs (policy.assist_gain; cost_aware only).
    assist_objective: AssistObjective = "ttft"


class AssistAssignment(msgspec.Struct, frozen=True, kw_only=True):
    """Value of `assist/<recovering worker>`, written by the coordinator (epoch-guarded):
    the recovering worker drafts for `survivor` through `endpoint`. The counters are the
    survivor's, copied by the coordinator as they grow (acceptance = accepted / drafted)."""

    id: str
    recovering: str
    survivor: str
    endpoint: str
    epoch: int
    assigned_at: float
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # The survivor's mean step time before the drafts (seconds; 0: not measured): what the
    # coordinator compares its assisted steps with to stop an assignment that hurts.
    step_s_before: float = 0.0


class StepEstimate(msgspec.Struct, frozen=True, kw_only=True):
    """One serving worker as draft-assist's predicted gain sees it (estimates.AssistInputs):
    None where not known (no step counters, or too little growth in the window)."""

    worker: str
    step_s: float | None  # recent mean step time (0: running nothing)
    verify_extra_s: float | None  # what verifying drafts would add to a step
    tokens_per_round: float  # tokens a verify step would emit per sequence
    gain: float | None  # policy.assist_gain
    inputs: str  # the inputs in words


class AssistEstimates(msgspec.Struct, frozen=True, kw_only=True):
    """Value of `assist_estimates`, written by the coordinator (epoch-guarded) when the
    figures change (rounded to 2 significant digits) and at least every
    ESTIMATES_REFRESH_S: what `lumenctl config show` lists."""

    at: float
    epoch: int
    workers: list[StepEstimate] = []


class RecoveryDecision(msgspec.Struct, frozen=True, kw_only=True):
    """One interrupted request's route (Algorithm 2's answer)."""

    request: str
    target: str  # the worker it continues on
    action: Literal["resume", "recompute"]
    reason: str
    at: float
    epoch: int
    holder: str = ""  # its checkpoint's holder ("" without a checkpoint)


class RecoveryPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Value of `recovery/<worker>`, written by the coordinator (epoch-guarded): where the
    requests interrupted on `worker` went. `decisions` keeps the newest ones only; the
    counters cover all of them. `engines` and `down_seen` tell when the worker serves again
    (a new active engine, or serving after it was seen down); the plan is deleted a while
    after that, or when no decision came for a long time."""

    worker: str
    cause: Literal["failed", "drained"]
    failed_at: float  # the first decision
    updated_at: float  # the latest decision
    epoch: int  # the coordinator that wrote it
    engines: list[str] = []  # the worker's active engines (id:pid) at the first decision
    down_seen: bool = False
    served_again_at: float | None = None
    total: int = 0
    resumed: int = 0
    recomputed: int = 0
    targets: dict[str, int] = {}  # decisions per target worker, all of them
    decisions: list[RecoveryDecision] = []  # the newest, oldest first


class Event(msgspec.Struct, frozen=True, kw_only=True):
    at: float
    kind: str
    source: str
    message: str
    epoch: int | None = None


_T = TypeVar("_T")


def encode_value(value: msgspec.Struct) -> bytes:
    return msgspec.json.encode(value)


def decode_value(data: bytes, kind: type[_T]) -> _T:
    """Decode and validate; raises `msgspec.ValidationError`/`DecodeError` naming the field."""
    return msgspec.json.decode(data, type=kind)
