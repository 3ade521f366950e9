"""Recovery plans (`recovery/<worker>`): where the requests interrupted on one worker went.

Pure functions over the record and the worker's record in a view; the coordinator service
adds each decision (`with_decision`) and, every cycle, moves each plan on (`advance`) and
writes what changed, guarded by its epoch. A plan is bounded: the newest `DECISIONS_KEPT`
decisions with their reasons cut to `REASON_CHARS`; its counters cover every decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from lumend.cluster.models import RecoveryDecision, RecoveryPlan, WorkerRecord

DECISIONS_KEPT = 64
REASON_CHARS = 240
RETAIN_S = 300.0  # a plan stays this long after its worker serves again
QUIET_S = 30.0  # a serving worker whose requests stopped breaking this long ago serves again
STALE_S = 3600.0  # an open plan without a decision for this long is deleted


def active_engines(worker: WorkerRecord | None) -> list[str]:
    if worker is None:
        return []
    return sorted(f"{e.id}:{e.pid}" for e in worker.engines if e.role == "active")


def new_plan(worker: str, cause: Literal["failed", "drained"], record: WorkerRecord | None,
             serving: bool, now: float, epoch: int) -> RecoveryPlan:
    """The plan of a failure whose first decision is being taken now; `serving`: whether the
    worker still looked serving then (a gateway saw its stream break before a heartbeat)."""
    return RecoveryPlan(worker=worker, cause=cause, failed_at=now, updated_at=now,
                        epoch=epoch, engines=active_engines(record), down_seen=not serving)


def with_decision(plan: RecoveryPlan, decision: RecoveryDecision,
                  keep: int = DECISIONS_KEPT) -> RecoveryPlan:
    if len(decision.reason) > REASON_CHARS:
        decision = msgspec.structs.replace(decision,
                                           reason=decision.reason[:REASON_CHARS - 1] + "…")
    targets = dict(plan.targets)
    targets[decision.target] = targets.get(decision.target, 0) + 1
    resumed = decision.action == "resume"
    return msgspec.structs.replace(
        plan, updated_at=max(plan.updated_at, decision.at), epoch=decision.epoch,
        total=plan.total + 1, resumed=plan.resumed + resumed,
        recomputed=plan.recomputed + (not resumed), targets=targets,
        decisions=[*plan.decisions, decision][-keep:] if keep > 0 else [])


@dataclass(frozen=True)
class Step:
    """What a cycle does with one plan: keep `plan` (written when it differs from the stored
    one) or delete it (`plan` None); `event`: a sentence for the event history, if any."""

    plan: RecoveryPlan | None
    event: str = ""


def advance(plan: RecoveryPlan, record: WorkerRecord | None, serving: bool, now: float,
            epoch: int, retain_s: float = RETAIN_S, stale_s: float = STALE_S,
            quiet_s: float = QUIET_S) -> Step:
    """Move a plan on from the worker's record in this cycle's view (`serving`: eligible
    for requests). The worker serves again when it is serving after it was seen down, or
    with another active engine than at the failure, or `quiet_s` after the last decision
    (its engine came back before any heartbeat showed it gone, or the break was a stall)."""
    if plan.served_again_at is not None:
        if now - plan.served_again_at >= retain_s:
            return Step(None)
        return Step(plan)
    if serving and (plan.down_seen or active_engines(record) != plan.engines
                    or now - plan.updated_at >= quiet_s):
        return Step(msgspec.structs.replace(plan, served_again_at=now, epoch=epoch),
                    f"{plan.worker} serves again {now - plan.failed_at:.1f} s after it "
                    f"{plan.cause}; {summary(plan)}")
    if now - plan.updated_at >= stale_s:
        return Step(None, f"recovery plan of {plan.worker} expired ({plan.worker} not back "
                          f"after {now - plan.failed_at:.0f} s); {summary(plan)}")
    if not serving and not plan.down_seen:
        return Step(msgspec.structs.replace(plan, down_seen=True, epoch=epoch))
    return Step(plan)


def summary(plan: RecoveryPlan) -> str:
    """"8 interrupted requests: 6 resumed, 2 recomputed; on w1 3, w2 3, w3 2"."""
    return (f"{plan.total} interrupted request{'s' if plan.total != 1 else ''}: "
            f"{plan.resumed} resumed, {plan.recomputed} recomputed; on "
            + ", ".join(f"{w} {n}" for w, n in sorted(plan.targets.items())))
