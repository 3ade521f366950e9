"""What `lumenctl status` and `lumenctl events` show, as plain data.

The table, JSON and YAML outputs all render these same documents, so they never disagree.
"""

from __future__ import annotations

from typing import Any

import msgspec

from lumend.cluster.models import AssistAssignment, Event, Intent, RecoveryPlan, WorkerRecord
from lumend.cluster.store import NOSPACE, NOSPACE_FIX
from lumend.cluster.view import ClusterView


def status_document(view: ClusterView) -> dict[str, Any]:
    coordinator: dict[str, Any] | None = None
    if view.coordinator is not None:
        record = view.coordinator.record
        status = view.coordinator_status
        decision = status.decision if status and status.epoch == view.coordinator.epoch else ""
        coordinator = {
            "node": record.node,
            "epoch": view.coordinator.epoch,
            "address": record.address,
            "rpc": record.rpc,
            "elected_at": record.elected_at,
            "decision": decision,
        }
    nodes = [
        {
            "name": n.name,
            "address": n.address,
            "state": n.state,
            "version": n.version,
            "pid": n.pid,
            "workers": list(n.workers),
            "status": n.status,
            "updated_at": n.updated_at,
            "intents": [_intent(i) for i in view.node_intents(n.name)],
        }
        for n in sorted(view.nodes.values(), key=lambda n: n.name)
    ]
    workers = [_worker(w, view.intents_for(w)) for w in sorted(view.workers.values(),
                                                                key=lambda w: w.name)]
    return {
        "cluster": view.cluster,
        "revision": view.revision,
        "etcd": _etcd(view),
        "coordinator": coordinator,
        "nodes": nodes,
        "workers": workers,
        "intents": [_intent(i) for i in view.intents],
        "assists": [_assist(a) for _, a in sorted(view.assists.items())],
        "recoveries": [_recovery(p) for _, p in sorted(view.recoveries.items())],
        "problems": [{"key": p.key, "reason": p.reason} for p in view.problems],
    }


def _etcd(view: ClusterView) -> dict[str, Any] | None:
    """etcd's own health as read with the view: database size, alarms, and for NOSPACE the
    command that clears it (etcd refuses every write until then)."""
    store = view.store
    if store is None:
        return None
    return {
        "endpoint": store.endpoint,
        "db_size_bytes": store.db_size_bytes,
        "alarms": list(store.alarms),
        "fix": NOSPACE_FIX if NOSPACE in store.alarms else None,
    }


def _assist(a: AssistAssignment) -> dict[str, Any]:
    """A draft-assist assignment; acceptance = accepted / drafted (null before any draft)."""
    return {
        "id": a.id, "recovering": a.recovering, "survivor": a.survivor, "endpoint": a.endpoint,
        "epoch": a.epoch, "assigned_at": a.assigned_at, "drafted_tokens": a.drafted_tokens,
        "accepted_tokens": a.accepted_tokens,
        "acceptance": a.accepted_tokens / a.drafted_tokens if a.drafted_tokens else None,
    }


def _recovery(plan: RecoveryPlan) -> dict[str, Any]:
    """A recovery plan: the record as stored (`decisions` holds the newest only; the
    counters cover all of them)."""
    doc: dict[str, Any] = msgspec.to_builtins(plan)
    return doc


def checkpoints_document(view: ClusterView) -> dict[str, Any]:
    """Per holder worker: bytes held against its budget and requests held; the balance
    ratio (most over least bytes held among workers with a budget) says whether placement
    spreads checkpoints (1.0 is even; null when some holder holds nothing).

    Coverage is the share of a worker's running requests whose checkpoint is complete, as
    its engine reports it; null when nothing runs, or when the engine does not report it
    (`requests_running` null too: unknown, which is not 0). The cluster's coverage counts
    the workers that report it; `coverage_unknown` names the others."""
    workers = sorted(view.workers.values(), key=lambda w: w.name)
    held = [w.checkpoints.bytes_held for w in workers if w.checkpoints.budget_bytes]
    balance = (max(held) / min(held)) if held and min(held) > 0 else None
    holders: list[dict[str, Any]] = [
        {"worker": w.name, "node": w.node, "bytes_held": w.checkpoints.bytes_held,
         "budget_bytes": w.checkpoints.budget_bytes, "requests": w.checkpoints.requests,
         "fill": (w.checkpoints.bytes_held / w.checkpoints.budget_bytes
                  if w.checkpoints.budget_bytes else None),
         "requests_running": w.load.ckpt_running,
         "requests_checkpointed": w.load.ckpt_complete,
         "coverage": _coverage(w.load.ckpt_running, w.load.ckpt_complete)}
        for w in workers
    ]
    known = [h for h in holders if h["requests_running"] is not None]
    running = sum(h["requests_running"] for h in known) if known else None
    checkpointed = sum(h["requests_checkpointed"] or 0 for h in known) if known else None
    return {"cluster": view.cluster, "holders": holders,
            "bytes_held": sum(w.checkpoints.bytes_held for w in workers),
            "requests": sum(w.checkpoints.requests for w in workers), "balance_ratio": balance,
            "requests_running": running, "requests_checkpointed": checkpointed,
            "coverage": _coverage(running, checkpointed),
            "coverage_unknown": [h["worker"] for h in holders if h["requests_running"] is None]}


def _coverage(running: int | None, complete: int | None) -> float | None:
    if not running or complete is None:
        return None
    return min(complete, running) / running


def events_document(cluster: str, events: list[Event]) -> dict[str, Any]:
    return {"cluster": cluster, "events": [msgspec.to_builtins(e) for e in events]}


def _worker(worker: WorkerRecord, intents: list[Intent]) -> dict[str, Any]:
    return {
        "name": worker.name,
        "node": worker.node,
        "state": worker.state,
        "stalled": worker.stalled or None,
        "engine": worker.engine,
        "model": worker.model,
        "gpus": list(worker.gpus),
        "engines": [msgspec.to_builtins(e) for e in worker.engines],
        "load": msgspec.to_builtins(worker.load),
        "checkpoints": msgspec.to_builtins(worker.checkpoints),
        "draft": worker.draft or None,
        "assist": msgspec.to_builtins(worker.assist),
        "intents": [_intent(i) for i in intents],
        "updated_at": worker.updated_at,
    }


def _intent(intent: Intent) -> dict[str, Any]:
    return {
        "kind": intent.kind,
        "target": intent.target,
        "target_kind": intent.target_kind,
        "requested_at": intent.requested_at,
        "requested_by": intent.requested_by,
        "reason": intent.reason,
        "migrate": intent.migrate,
    }
