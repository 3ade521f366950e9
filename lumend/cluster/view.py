"""A read model of the whole cluster, decoded from one snapshot of the etcd prefix.

The node's HA loop and lumenctl both decide from a `ClusterView` built fresh each time;
nothing is remembered between reads. Values that do not decode are collected in
`problems` (key and reason) and skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from lumend.cluster.keys import Keys
from lumend.cluster.models import (
    AssistAssignment,
    AssistEstimates,
    ClusterSettings,
    CoordinatorRecord,
    CoordinatorStatus,
    Event,
    Intent,
    NodeRecord,
    RecoveryPlan,
    WorkerRecord,
    decode_value,
)
from lumend.cluster.store import KeyValue, Snapshot, StoreStatus
from lumend.coordinator.settings import SettingError
from lumend.coordinator.settings import check as check_settings

_T = TypeVar("_T")


@dataclass(frozen=True)
class Coordinator:
    record: CoordinatorRecord
    epoch: int  # the coordinator key's create revision
    lease: int


@dataclass(frozen=True)
class Problem:
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}"


@dataclass(frozen=True)
class ClusterView:
    cluster: str
    revision: int
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    workers: dict[str, WorkerRecord] = field(default_factory=dict)
    coordinator: Coordinator | None = None
    coordinator_status: CoordinatorStatus | None = None
    intents: list[Intent] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    # The `config` key; None when absent or invalid (then the defaults apply).
    settings: ClusterSettings | None = None
    # Draft-assist assignments by recovering worker (`assist/<worker>`).
    assists: dict[str, AssistAssignment] = field(default_factory=dict)
    # Recovery plans by the worker whose requests they routed (`recovery/<worker>`).
    recoveries: dict[str, RecoveryPlan] = field(default_factory=dict)
    # etcd's database size and alarms (NOSPACE), when the read carried them.
    store: StoreStatus | None = None
    # The coordinator's step estimates for draft-assist (`assist_estimates`).
    assist_estimates: AssistEstimates | None = None

    def intents_for(self, worker: WorkerRecord) -> list[Intent]:
        """Intents that name this worker or its node."""
        return [i for i in self.intents if i.target in (worker.name, worker.node)]

    def node_intents(self, node: str) -> list[Intent]:
        return [i for i in self.intents if i.target_kind == "node" and i.target == node]


def build_view(keys: Keys, snapshot: Snapshot) -> ClusterView:
    nodes: dict[str, NodeRecord] = {}
    workers: dict[str, WorkerRecord] = {}
    intents: list[Intent] = []
    events: list[Event] = []
    problems: list[Problem] = []
    coordinator: Coordinator | None = None
    status: CoordinatorStatus | None = None
    settings: ClusterSettings | None = None
    assists: dict[str, AssistAssignment] = {}
    recoveries: dict[str, RecoveryPlan] = {}
    estimates: AssistEstimates | None = None

    def decode(kv: KeyValue, kind: type[_T]) -> _T | None:
        try:
            return decode_value(kv.value, kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            problems.append(Problem(kv.key, f"not a valid {kind.__name__}: {exc}"))
            return None

    for kv in snapshot.kvs:
        key = kv.key
        if key.startswith(keys.nodes):
            node = decode(kv, NodeRecord)
            if node is not None:
                if node.name != key.removeprefix(keys.nodes):
                    problems.append(Problem(key, f"names node {node.name!r}, not its key"))
                else:
                    nodes[node.name] = node
        elif key.startswith(keys.workers):
            worker = decode(kv, WorkerRecord)
            if worker is not None:
                if worker.name != key.removeprefix(keys.workers):
                    problems.append(Problem(key, f"names worker {worker.name!r}, not its key"))
                else:
                    workers[worker.name] = worker
        elif key.startswith(keys.intents):
            intent = decode(kv, Intent)
            if intent is not None:
                intents.append(intent)
        elif key.startswith(keys.events):
            event = decode(kv, Event)
            if event is not None:
                events.append(event)
        elif key.startswith(keys.assists):
            assignment = decode(kv, AssistAssignment)
            if assignment is not None:
                if assignment.recovering != key.removeprefix(keys.assists):
                    problems.append(Problem(key, f"names worker {assignment.recovering!r}, "
                                            "not its key"))
                else:
                    assists[assignment.recovering] = assignment
        elif key.startswith(keys.recoveries):
            plan = decode(kv, RecoveryPlan)
            if plan is not None:
                if plan.worker != key.removeprefix(keys.recoveries):
                    problems.append(Problem(key, f"names worker {plan.worker!r}, not its key"))
                else:
                    recoveries[plan.worker] = plan
        elif key == keys.coordinator:
            record = decode(kv, CoordinatorRecord)
            if record is not None:
                coordinator = Coordinator(record, kv.create_revision, kv.lease)
        elif key == keys.coordinator_status:
            status = decode(kv, CoordinatorStatus)
        elif key == keys.assist_estimates:
            estimates = decode(kv, AssistEstimates)
        elif key == keys.config:
            settings = decode(kv, ClusterSettings)
            if settings is not None:
                try:
                    settings = check_settings(settings)
                except SettingError as exc:
                    problems.append(Problem(key, f"{exc}; the defaults apply until fixed"))
                    settings = None
        else:
            problems.append(Problem(key, "unknown key under the LUMEN prefix"))

    return ClusterView(
        cluster=keys.cluster,
        revision=snapshot.revision,
        nodes=nodes,
        workers=workers,
        coordinator=coordinator,
        coordinator_status=status,
        intents=intents,
        events=events,
        problems=problems,
        settings=settings,
        assists=assists,
        assist_estimates=estimates,
        recoveries=recoveries,
        store=snapshot.store,
    )
