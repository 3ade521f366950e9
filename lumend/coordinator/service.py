"""The coordinator's decisions, served over gRPC by the node that holds the coordinator key.

State, and where it comes from:
* per-worker load and checkpoint bytes: the etcd view (heartbeats, read every HA cycle);
* requests admitted here and not finished (`Admit`/`Finish`/`Recover`): exact and fresh,
  but only for requests this coordinator admitted;
* checkpoint bytes per checkpoint and holder: streamed by every node's holder (`Progress`);
  a holder resends everything it holds when it connects to a new coordinator.
A worker's queue and checkpoint bytes are the larger of the heartbeat's and the count kept
here: the heartbeat also sees requests that bypassed the coordinator (a degraded gateway),
the count here sees admissions since the last heartbeat. So a newly elected coordinator
rebuilds from etcd and the holders alone; a gateway that outlives a coordinator brings its
request's placement along in `Recover`.

Policy settings come from the view (etcd `config`), so a `lumenctl config set` applies from
the next cycle. Decisions are the pure functions of lumend.coordinator.policy: by default
cost-aware (`decisions = cost_aware`: admission to the shortest queue, so checkpoint bytes
held are not serving load; placement and recovery in seconds, lumend.coordinator.settings),
or the paper's L_hat forms (`decisions = paper`).

Every recovery decision also goes into the failed worker's recovery plan
(`recovery/<worker>`, lumend.coordinator.plans), written by the next HA cycle with the
coordinator's other epoch-guarded writes (`lead_ops`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import msgspec

from lumend.cluster.keys import Keys
from lumend.cluster.models import (
    AssistAssignment,
    AssistEstimates,
    Event,
    RecoveryDecision,
    RecoveryPlan,
    StepEstimate,
    WorkerRecord,
    encode_value,
)
from lumend.cluster.store import Delete, Op, Put
from lumend.cluster.view import ClusterView
from lumend.coordinator.estimates import (
    ASSIST_SETTLE_S,
    HURT_COOLDOWN_MAX_S,
    HURT_COOLDOWN_S,
    HURT_MARGIN,
    MIN_JUDGED_DRAFTS,
    AssistInputs,
    CostEstimates,
    StepTracker,
    assist_inputs,
    draft_tokens,
    estimate,
    measured_inputs,
    tokens_per_round,
)
from lumend.coordinator.loadbook import (
    REQUEST_TTL_S,
    Admitted,
    Held,
    LoadBook,
    Table,
    target_of,
)
from lumend.coordinator.plans import RETAIN_S, STALE_S, advance, new_plan, with_decision
from lumend.coordinator.policy import (
    Mode,
    PolicyConfig,
    assist_target,
    completion_estimates,
    l_hat,
)
from lumend.coordinator.policy import recover as policy_recover
from lumend.coordinator.settings import costs_in_use, in_force, policy_config
from lumend.rpc.messages import (
    Admission,
    CheckpointProgress,
    CheckpointRef,
    RecoverAsk,
    Recovery,
)

__all__ = ["Admitted", "CoordinatorService", "Held", "NotReady", "eligible", "target_of"]

log = logging.getLogger("lumend.coordinator")

BLOCK_TOKENS = 16


class NotReady(Exception):
    """The coordinator has not read the cluster yet."""


def serving(view: ClusterView, worker: WorkerRecord) -> bool:
    """Serving, registered, with engines, and not drained. A drain intent counts from the
    moment it is in the view, before the worker's node publishes it as draining."""
    return (worker.state == "serving" and worker.node in view.nodes and bool(worker.engines)
            and not any(i.kind == "drain" for i in view.intents_for(worker)))


def eligible(view: ClusterView, worker: WorkerRecord) -> bool:
    """Serving and not stalled: only such a worker is admitted to, holds new checkpoints or
    takes an interrupted request (a stalled one is admitted to when no other can be)."""
    return serving(view, worker) and not worker.stalled


class CoordinatorService:
    def __init__(self, node: str, epoch: int, view: Callable[[], ClusterView | None], *,
                 plan_retain_s: float = RETAIN_S, plan_stale_s: float = STALE_S,
                 request_ttl_s: float = REQUEST_TTL_S) -> None:
        self.node = node
        self.epoch = epoch
        self._read_view = view
        # The cost figures measured from the latest view (lumend.coordinator.estimates), and
        # that view with them in its settings: the one every decision reads.
        self.costs: CostEstimates = estimate(())
        self._costed_from: ClusterView | None = None
        self._costed: ClusterView | None = None
        self.book = LoadBook(eligible, ttl_s=request_ttl_s)
        self.decisions: Counter[str] = Counter()  # admit, no_worker, resume, recompute, ...
        # Recent step times per worker, from the step counters of the views' records (the
        # predicted gain of draft-assist, assist_ops); drafters declined for want of a
        # positive gain (logged once until they are assigned or stop assisting).
        self.steps = StepTracker()
        self._declined: set[str] = set()
        # (drafter, survivor) pairs whose assignment hurt: not paired again until the
        # first time, with the cooldown that got them there (doubled at each repeat).
        self._benched: dict[tuple[str, str], tuple[float, float]] = {}
        # The step estimates last published (rounded) and when (`assist_estimates`).
        self._published: tuple[tuple[object, ...], ...] | None = None
        self._published_at = -math.inf
        self._event_seq = 0
        # Recovery plans changed here and not yet read back from etcd, by failed worker.
        self._plans: dict[str, RecoveryPlan] = {}
        self._plan_retain_s = plan_retain_s
        self._plan_stale_s = plan_stale_s
        # Checkpoint ids: this term's random half and a count (unique as uuid4s, and cheaper
        # per admission: no urandom call).
        self._ckpt_prefix = uuid.uuid4().hex[:16]
        self._ckpt_seq = itertools.count()

    @property
    def requests(self) -> Mapping[str, Admitted]:
        """Requests admitted here and not finished (nor expired), by id."""
        return self.book.requests

    @property
    def held(self) -> Mapping[str, Held]:
        """What each checkpoint's holder reported, by checkpoint id."""
        return self.book.held

    # -- inputs -------------------------------------------------------------------------------

    def _table(self, view: ClusterView, alive: Callable[[WorkerRecord], bool],
               assist: dict[int, AssistInputs] | None = None) -> Table:
        """The load table over the workers `alive` accepts (cold paths: O(workers)).

        With `assist` (a dict it fills): also the predicted gain of draft-assisting each of
        them (`LoadSnapshot.assist_gain`, policy.assist_gain over the inputs of
        lumend.coordinator.estimates, put in `assist` by index), or assist_gain None when
        any of them runs something and has no recent step time (`self.steps`)."""
        cols = self.book.columns(view)
        table = self.book.table(cols, tuple(ok and alive(w) for ok, w in
                                            zip(cols.eligible, cols.workers, strict=True)))
        if assist is None:
            return table
        # The acceptance this model's drafts reached so far, over its current assignments.
        drafted: Counter[str] = Counter()
        accepted: Counter[str] = Counter()
        for a in view.assists.values():
            survivor = view.workers.get(a.survivor)
            if survivor is not None:
                drafted[survivor.model] += a.drafted_tokens
                accepted[survivor.model] += a.accepted_tokens
        prefill = table.cfg.recompute_s_per_token  # the cost model in use
        gains = [-math.inf] * len(table.workers)
        known = True
        for i, (ok, w) in enumerate(zip(table.snapshot.alive, table.workers, strict=True)):
            if not ok:
                continue
            k = draft_tokens(w.engine)
            inputs = assist_inputs(w.load, self.steps.rate(w.name), k,
                                   tokens_per_round(k, drafted[w.model], accepted[w.model]),
                                   prefill, table.cfg.assist_objective)
            if inputs is None:
                known = False
                continue
            assist[i] = inputs
            gains[i] = inputs.gain
        if not known:
            return table
        return dataclasses.replace(table, snapshot=dataclasses.replace(table.snapshot,
                                                                       assist_gain=gains))

    def term_lease(self) -> int | None:
        """The lease carrying this term's coordinator key, as the latest view shows it; None
        when the view names no coordinator (yet: the first cycle of a term), 0 (no lease)
        when it names another term."""
        view = self._view()
        c = None if view is None else view.coordinator
        if c is None:
            return None
        return c.lease if c.epoch == self.epoch else 0

    def _view(self) -> ClusterView | None:
        return self.with_costs(self._read_view())

    def with_costs(self, view: ClusterView | None) -> ClusterView | None:
        """`view` with the cost figures measured from its workers in its settings
        (`settings.InForce`); the same object for the same view, so the load book's columns
        are built once per view."""
        if view is None or view is self._costed:
            return view
        if view is not self._costed_from:
            costs = costs_in_use(view.settings, view.workers.values())
            if costs.differs(self.costs):
                log.info("cost model: %s", costs.describe())
            self.costs = costs
            self._costed_from = view
            self._costed = dataclasses.replace(view, settings=in_force(view.settings, costs))
        assert self._costed is not None
        return self._costed

    def _costed_view(self, view: ClusterView) -> ClusterView:
        costed = self.with_costs(view)
        assert costed is not None
        return costed

    def _read(self) -> ClusterView:
        view = self._view()
        if view is None:
            raise NotReady("the coordinator has not read the cluster yet; retry")
        return view

    # -- decisions ----------------------------------------------------------------------------

    def admit(self, request_id: str, model: str | None, gateway: str,
              exclude: Sequence[str] = ()) -> Admission:
        view = self._read()
        book = self.book
        cols = book.columns(view)
        alive: Sequence[bool] = cols.serving(model)
        skip = [i for i in map(cols.index.get, exclude) if i is not None] if exclude else ()
        if skip:
            alive = list(alive)
            for i in skip:
                alive[i] = False
        cfg = cols.cfg
        mode = cfg.mode.value
        index = book.least_loaded(cols, alive)
        stalled_only = ""
        if index is None:  # rather a stalled worker (it may answer again) than a refusal
            fallback = [i not in skip and serving(view, w) and bool(w.stalled)
                        and (not model or w.model == model)
                        for i, w in enumerate(cols.workers)]
            index = min((i for i, ok in enumerate(fallback) if ok),
                        key=lambda i: (cols.queue[i], i), default=None)
            if index is not None:
                stalled_only = (f" (every other worker unavailable; it is stalled: "
                                f"{cols.workers[index].stalled})")
        if index is None:
            self.decisions["no_worker"] += 1
            what = f"model {model!r}" if model else "any model"
            return Admission(self.epoch, None, None,
                             f"no serving worker for {what} ({len(set(exclude))} excluded)",
                             mode)
        worker = cols.workers[index]
        if cfg.admission == "queue":  # cost-aware: checkpoint bytes held do not count
            reason = f"admitted to {worker.name} (queue {cols.queue[index]}, the shortest)"
        else:
            reason = (f"admitted to {worker.name} (L_hat "
                      f"{l_hat(cols.ckpt[index], cols.queue[index], cfg):.3g}, the lowest)")
        reason += stalled_only
        # The size is not known up front; one byte asks for a holder with any budget at all.
        placed = book.holder(cols, index)
        ckpt = None
        if placed is not None:
            h, load = placed
            holder = cols.workers[h]
            ckpt = CheckpointRef(f"{self._ckpt_prefix}{next(self._ckpt_seq):016x}", holder.name,
                                 cols.endpoint(h))
            reason += f"; checkpoint on {holder.name} (L_hat {load:.3g})"
        else:
            reason += "; no checkpoint" + (" (policy stop_and_restart)"
                                            if not cfg.checkpoints else
                                            " (no holder has budget)")
        book.admit(request_id, worker.name, ckpt, gateway, view)
        self.decisions["admit"] += 1
        return Admission(self.epoch, cols.target(index), ckpt, reason, mode)

    def finish(self, request_id: str) -> bool:
        return self.book.finish(request_id) is not None

    def finish_many(self, request_ids: Iterable[str]) -> int:
        """Finish a batch; returns how many were known here."""
        finish = self.book.finish
        return sum(finish(r) is not None for r in request_ids)

    def recover(self, ask: RecoverAsk) -> Recovery:
        view = self._read()
        failed = view.workers.get(ask.failed_worker)
        model = failed.model if failed is not None else ask.model

        def survives(w: WorkerRecord) -> bool:
            return w.name != ask.failed_worker and model in ("", w.model)

        # The request leaves the failed worker's queue before the decision.
        known = self.book.unassign(ask.request_id)
        checkpoint = ask.checkpoint or (known.checkpoint if known else None)
        table = self._table(view, survives)
        mode = table.cfg.mode.value
        holder = table.index(checkpoint.holder) if checkpoint is not None else None
        blocks = self._checkpointed_blocks(checkpoint, ask.prefix_tokens)
        cfg = table.cfg
        # Cost-aware: by estimated completion of the whole context (prefix_tokens).
        total = ask.prefix_tokens
        route = policy_recover(table.snapshot, holder, blocks, cfg, total)
        if route is None:
            self.decisions["no_survivor"] += 1
            return Recovery(self.epoch, None, False,
                            f"no survivor serves model {model!r}", mode)
        worker = table.workers[route.worker]
        kind: Literal["resume", "recompute"] = "resume" if route.resume else "recompute"
        self.decisions[kind] += 1
        if checkpoint is None:
            why = "no checkpoint"
        elif holder is None:
            why = f"holder {checkpoint.holder} is not serving"
        elif cfg.cost_aware and cfg.mode is Mode.lumen and cfg.adaptive_routing:
            resume_s, target, recompute_s = completion_estimates(table.snapshot, holder,
                                                                 blocks, total, cfg)
            away = "" if target is None else f" on {table.workers[target].name}"
            why = (f"prefix {blocks} blocks; est. resume on {checkpoint.holder} "
                   f"{resume_s:.3g} s, recompute{away} {recompute_s:.3g} s")
        elif cfg.cost_aware:  # a baseline's routing; L_hat in seconds, theta/tau unused
            why = (f"holder {checkpoint.holder} L_hat {table.load(holder):.3g} s, prefix "
                   f"{blocks} blocks")
        else:
            why = (f"holder {checkpoint.holder} L_hat {table.load(holder):.3g} "
                   f"(theta {table.cfg.theta:g}), prefix {blocks} blocks (tau {table.cfg.tau})")
        # A drain --migrate moves requests off a worker that still runs, the same way.
        left = ("is drained" if failed is not None and any(
            i.kind == "drain" for i in view.intents_for(failed)) else "failed")
        if left == "is drained":
            self.decisions["migrate"] += 1
        reason = f"{kind} on {worker.name} after {ask.failed_worker} {left}: {why}"
        log.info("recovery of %s: %s", ask.request_id, reason)
        # After the reason: admitting changes the table's live columns the estimates read.
        self.book.admit(ask.request_id, worker.name, checkpoint, ask.gateway, view)
        self._plan(view, ask.failed_worker, "drained" if left == "is drained" else "failed",
                   RecoveryDecision(request=ask.request_id, target=worker.name, action=kind,
                                    reason=reason, at=time.time(), epoch=self.epoch,
                                    holder=checkpoint.holder if checkpoint else ""))
        return Recovery(self.epoch, target_of(worker), route.resume, reason, mode)

    def _plan(self, view: ClusterView, failed: str, cause: Literal["failed", "drained"],
              decision: RecoveryDecision) -> None:
        plan = self._plans.get(failed) or view.recoveries.get(failed)
        if plan is None or plan.served_again_at is not None:  # a new failure
            record = view.workers.get(failed)
            plan = new_plan(failed, cause, record,
                            record is not None and eligible(view, record), decision.at,
                            self.epoch)
        self._plans[failed] = with_decision(plan, decision)

    def _checkpointed_blocks(self, checkpoint: CheckpointRef | None, prefix_tokens: int) -> int:
        """|C_r| in blocks: what the holder reported holding, else the gateway's prefix."""
        if checkpoint is None:
            return 0
        held = self.held.get(checkpoint.ckpt_id)
        tokens = prefix_tokens if held is None else min(prefix_tokens, held.tokens)
        return tokens // BLOCK_TOKENS

    def progress(self, report: CheckpointProgress) -> bool:
        """Record one holder report; returns whether this coordinator placed that checkpoint."""
        return self.book.progress(report)

    def loads(self) -> dict[str, float]:
        """L_hat of every live worker as the next decision would see it (inf: not serving)."""
        return self.book.loads(self._read())

    def expire(self, view: ClusterView | None = None) -> int:
        """Forget requests whose gateway is gone or that outlived the TTL (also done on
        every new view); returns how many."""
        return self.book.expire(self.with_costs(view) if view is not None else self._view())

    # -- the coordinator's writes, every HA cycle ----------------------------------------------

    def lead_ops(self, view: ClusterView, keys: Keys, now: float | None = None) -> list[Op]:
        """Everything this coordinator writes this cycle (guarded by its epoch)."""
        now = time.time() if now is None else now
        view = self._costed_view(view)
        self.book.columns(view)  # a new view: its heartbeats in, dead gateways' requests out
        return self.assist_ops(view, keys, now) + self.recovery_ops(view, keys, now)

    def recovery_ops(self, view: ClusterView, keys: Keys, now: float | None = None) -> list[Op]:
        """The writes that make `recovery/` hold every plan as this cycle leaves it: new
        decisions in, a worker that serves again marked (an event sums its plan up), plans
        past their retention deleted."""
        now = time.time() if now is None else now
        ops: list[Op] = []
        for name in sorted(set(view.recoveries) | set(self._plans)):
            stored = view.recoveries.get(name)
            plan = self._plans.get(name, stored)
            assert plan is not None
            record = view.workers.get(name)
            step = advance(plan, record, record is not None and eligible(view, record), now,
                           self.epoch, self._plan_retain_s, self._plan_stale_s)
            if step.event:
                log.info("recovery plan: %s", step.event)
                ops.append(self._event(keys, now, "recovery_plan", step.event, "-recovery"))
            if step.plan is None:
                self._plans.pop(name, None)
                if stored is not None:
                    ops.append(Delete(keys.recovery(name)))
            elif step.plan == stored:
                self._plans.pop(name, None)  # written and read back
            else:
                self._plans[name] = step.plan
                ops.append(Put(keys.recovery(name), encode_value(step.plan)))
        return ops

    # -- draft-assist (Algorithm 3) -------------------------------------------------------------

    def assist_ops(self, view: ClusterView, keys: Keys, now: float | None = None) -> list[Op]:
        """The writes that make `assist/` match the cluster: a worker that reports
        `assisting` (its draft server up) drafts for a serving worker of its model that no
        other drafter assists. Cost-aware (the default), the one with the highest positive
        predicted gain (policy.assist_gain from measured step times, `_table`), and for
        none while no gain is positive (asked again every cycle); when a candidate has no
        recent step time, and with `decisions = paper`, the most loaded (argmax L_hat,
        Algorithm 3 as published). The event's reason says which rule chose. An assignment
        ends when its worker stops assisting (its engine serves again, or it left) or its
        survivor stops serving; the survivor's accepted/drafted counters are copied into
        the assignment as they grow. Decided from this view and the step counters of the
        views before it (the caller writes the ops guarded by the epoch)."""
        now = time.time() if now is None else now
        ops: list[Op] = []
        view = self._costed_view(view)
        self.steps.observe(view.workers.values())
        policy = policy_config(view.settings)
        kept: dict[str, AssistAssignment] = {}
        for name, a in sorted(view.assists.items()):
            worker = view.workers.get(name)
            survivor = view.workers.get(a.survivor)
            if worker is None or worker.state != "assisting" or worker.draft != a.endpoint:
                why = ("it left" if worker is None else
                       f"it is {worker.state}" if worker.state != "assisting" else
                       "its draft server moved")
            elif survivor is None or not serving(view, survivor):  # a stall passes
                why = f"survivor {a.survivor} is not serving"
            elif not policy.uses_assist:
                why = f"policy {policy.mode.value} has no draft-assist"
            else:
                why = self._hurts(a, survivor, policy, now) \
                    if policy.cost_aware else ""
            if why:
                self.decisions["assist_end"] += 1
                ops += [Delete(keys.assist(name)),
                        self._event(keys, now, "assist_ended",
                                    f"{name} stopped drafting for {a.survivor} ({why}): "
                                    f"{_acceptance(a)}", "-assist")]
                continue
            kept[name] = a
            assert survivor is not None
            usage = survivor.assist
            if (usage is not None and usage.assignment == a.id
                    and (usage.drafted_tokens, usage.accepted_tokens)
                    != (a.drafted_tokens, a.accepted_tokens)):
                ops.append(Put(keys.assist(name), encode_value(msgspec.structs.replace(
                    a, drafted_tokens=usage.drafted_tokens,
                    accepted_tokens=usage.accepted_tokens))))
        if not policy.uses_assist:
            return ops
        if policy.cost_aware:
            ops += self._estimate_ops(view, keys, now)
        assisted = {a.survivor for a in kept.values()}
        self._declined &= {w.name for w in view.workers.values() if w.state == "assisting"}
        # A pair benched long enough ago is forgotten: its next cooldown starts anew.
        self._benched = {pair: b for pair, b in self._benched.items()
                         if b[0] > now - HURT_COOLDOWN_MAX_S}
        for worker in sorted(view.workers.values(), key=lambda w: w.name):
            if (worker.state != "assisting" or not worker.draft or worker.name in kept
                    or worker.node not in view.nodes):
                continue

            def target(w: WorkerRecord, me: WorkerRecord = worker) -> bool:
                return (eligible(view, w) and w.name != me.name and w.model == me.model
                        and w.name not in assisted
                        and self._benched.get((me.name, w.name), (0.0, 0.0))[0] <= now)

            inputs: dict[int, AssistInputs] = {}
            table = self._table(view, target, inputs if policy.cost_aware else None)
            cfg = table.cfg
            gains = table.snapshot.assist_gain
            if cfg.cost_aware and gains is None:
                # A candidate runs requests and has no recent step time (its engine exports
                # no step counters, or too little grew yet): no predicted gain, so
                # Algorithm 3 as published, the most loaded by L_hat (here in seconds).
                cfg = dataclasses.replace(cfg, cost_aware=False)
            index = assist_target(table.snapshot, cfg)
            if index is None:
                if gains is not None and worker.name not in self._declined and inputs:
                    self._declined.add(worker.name)
                    best = max(inputs, key=lambda i: gains[i])
                    log.info("assist: %s drafts for no one: no survivor's predicted gain is "
                             "positive (best %s, %+.3f: %s); re-evaluated every cycle",
                             worker.name, table.workers[best].name, gains[best],
                             inputs[best].describe())
                continue
            self._declined.discard(worker.name)
            survivor = table.workers[index]
            before = inputs[index].step_s if gains is not None and index in inputs else 0.0
            a = AssistAssignment(id=f"{worker.name}:{uuid.uuid4().hex[:8]}",
                                 recovering=worker.name, survivor=survivor.name,
                                 endpoint=worker.draft, epoch=self.epoch, assigned_at=now,
                                 step_s_before=before)
            assisted.add(survivor.name)
            self.decisions["assist"] += 1
            if gains is not None:
                why = (f"predicted gain {gains[index]:+.3f}, the highest: "
                       f"{inputs[index].describe()}")
            elif table.cfg.cost_aware:
                lacking = sorted(table.workers[i].name for i, ok
                                 in enumerate(table.snapshot.alive) if ok and i not in inputs)
                why = (f"L_hat {table.load(index):.3g} s, the most loaded; L_hat, no step "
                       f"costs for {', '.join(lacking)}")
            else:
                why = f"L_hat {table.load(index):.3g}, the most loaded"
            reason = f"{worker.name} drafts for {survivor.name} ({why}) through {worker.draft}"
            log.info("assist: %s", reason)
            # etcd refuses a transaction naming a key twice: the put replaces the delete.
            ops = [op for op in ops
                   if not (isinstance(op, Delete) and op.key == keys.assist(worker.name))]
            ops += [Put(keys.assist(worker.name), encode_value(a)),
                    self._event(keys, now, "assist_assigned", reason, "-assist")]
        return ops

    def _estimate_ops(self, view: ClusterView, keys: Keys, now: float) -> list[Op]:
        """The step estimates of every serving worker, as draft-assist's gain sees them, for
        `lumenctl config show`: written when a figure changes at 2 significant digits, or
        ESTIMATES_REFRESH_S after the last write (its `at` says how fresh it is)."""
        inputs: dict[int, AssistInputs] = {}
        table = self._table(view, lambda w: eligible(view, w), inputs)
        rows: list[StepEstimate] = []
        for i, (ok, w) in enumerate(zip(table.snapshot.alive, table.workers, strict=True)):
            if not ok:
                continue
            x = inputs.get(i)
            if x is None:
                rows.append(StepEstimate(
                    worker=w.name, step_s=None, verify_extra_s=None, gain=None,
                    tokens_per_round=_two_digits(tokens_per_round(draft_tokens(w.engine))),
                    inputs="no recent step time (no step counters, or too little growth)"))
                continue
            rows.append(StepEstimate(
                worker=w.name, step_s=_two_digits(x.step_s),
                verify_extra_s=_two_digits(x.verify_extra_s),
                tokens_per_round=_two_digits(x.tokens_per_round), gain=_two_digits(x.gain),
                inputs=x.describe()))
        figures = tuple((r.worker, r.step_s, r.verify_extra_s, r.tokens_per_round, r.gain)
                        for r in rows)
        if figures == self._published and now - self._published_at < ESTIMATES_REFRESH_S:
            return []
        self._published, self._published_at = figures, now
        return [Put(keys.assist_estimates, encode_value(
            AssistEstimates(at=now, epoch=self.epoch, workers=rows)))]

    def _hurts(self, a: AssistAssignment, survivor: WorkerRecord, cfg: PolicyConfig,
               now: float) -> str:
        """Why assignment `a` should end because it slows its survivor down, or "": its
        gain measured on its own steps (estimates.measured_inputs: the step time before the
        drafts against the steps since, at the acceptance reached) below -HURT_MARGIN, once
        MIN_JUDGED_DRAFTS were verified. The pair is then benched (HURT_COOLDOWN_S, doubled
        at each repeat up to HURT_COOLDOWN_MAX_S)."""
        if a.step_s_before <= 0 or a.drafted_tokens < MIN_JUDGED_DRAFTS:
            return ""
        assisted = self.steps.rate(survivor.name, since=a.assigned_at + ASSIST_SETTLE_S)
        if assisted is None:
            return ""
        k = draft_tokens(survivor.engine)
        tpr = tokens_per_round(k, a.drafted_tokens, a.accepted_tokens)
        inputs = measured_inputs(survivor.load, a.step_s_before, assisted, tpr,
                                 cfg.recompute_s_per_token, cfg.assist_objective)
        if inputs is None or inputs.gain >= -HURT_MARGIN:
            return ""
        pair = (a.recovering, a.survivor)
        cooldown = self._benched.get(pair, (0.0, HURT_COOLDOWN_S / 2))[1] * 2
        cooldown = min(HURT_COOLDOWN_MAX_S, cooldown)
        self._benched[pair] = (now + cooldown, cooldown)
        self.decisions["assist_hurt"] += 1
        return (f"it hurts: measured gain {inputs.gain:+.3f}, step "
                f"{a.step_s_before * 1e3:.3g} ms before the drafts and "
                f"{assisted.step_s * 1e3:.3g} ms with them; not paired again for "
                f"{cooldown:g} s")

    def _event(self, keys: Keys, now: float, kind: str, message: str, duty: str) -> Put:
        self._event_seq = (self._event_seq + 1) % 10000
        event = Event(at=now, kind=kind, source=self.node, message=message, epoch=self.epoch)
        return Put(keys.event(int(now * 1000), self.node + duty, self._event_seq),
                   encode_value(event))


ESTIMATES_REFRESH_S = 30.0


def _two_digits(x: float) -> float:
    return float(f"{x:.2g}")


def _acceptance(a: AssistAssignment) -> str:
    if not a.drafted_tokens:
        return "no drafts verified"
    return (f"acceptance {a.accepted_tokens / a.drafted_tokens:.2f} ({a.accepted_tokens} of "
            f"{a.drafted_tokens} drafted tokens)")
