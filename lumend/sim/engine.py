"""The discrete-event cluster simulator.

Iteration-level: each worker runs engine steps like vLLM with chunked prefill (Sarathi):
every running sequence decodes one token per step, and prefill chunks fill the rest of a
token budget, first come first served, while KV memory lasts. Step times come from the cost
model. Events (a heap) are step ends, faults, checkpoint restores, draft-model ready, model
reload done and queue-depth samples; arrivals are merged from the sorted workload.

Speed: no per-token Python work. While a worker's batch does not change (decode only, no
prefill waiting), its steps are advanced analytically as one *run* that ends at the next
completion (the step times form an arithmetic series, since only the context term grows); an
arrival or other change truncates the run to the end of the step in progress. A running
request stores the step at which it completes, so advancing a run touches no request.

Checkpoints are modelled per serving worker as a byte backlog drained at the link bandwidth:
what is still in the backlog when the worker fails is lost (split evenly across its
requests), and only whole blocks count. Placement and routing call
lumend/coordinator/policy.py, exactly as the coordinator does.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, replace

from lumend.coordinator import policy
from lumend.engine.costmodel import CostModel, load_cost_model
from lumend.sim.config import FaultKind, SimConfig
from lumend.sim.workload import Workload

IDLE, STEP, RUN = 0, 1, 2
EV_STEP, EV_FAULT, EV_RESTORE, EV_DRAFT, EV_RELOAD, EV_SAMPLE, EV_GRAY_END = range(7)


class SimError(RuntimeError):
    """A workload or configuration the simulator cannot run (e.g. a request larger than KV)."""


class Req:
    __slots__ = (
        "arrival",
        "ckpt_tokens",
        "completions",
        "ctx",
        "ctx_join",
        "end_step",
        "epoch",
        "finish",
        "first_token",
        "gen_join",
        "generated",
        "hold_bytes",
        "holder",
        "interrupted_at",
        "join_step",
        "output",
        "prompt",
        "replay_first",
        "resident_at_fault",
        "resumed",
        "rid",
        "todo",
        "worker",
    )

    def __init__(self, rid: int, arrival: float, prompt: int, output: int) -> None:
        self.rid = rid
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.worker = -1
        self.holder = -1
        self.hold_bytes = 0.0
        self.todo = prompt           # tokens still to prefill where it is placed
        self.ctx = 0.0               # tokens resident in KV (while not decoding)
        self.generated = 0           # tokens delivered to the client (while not decoding)
        self.join_step = 0           # worker step when it joined the decode batch
        self.ctx_join = 0.0
        self.gen_join = 0
        self.end_step = 0            # worker step at which it completes
        self.first_token = -1.0
        self.finish = -1.0
        self.completions = 0
        self.epoch = 0               # bumps on every move, to drop stale restore events
        self.interrupted_at = -1.0   # fault time, if its stream was interrupted
        self.replay_first = -1.0     # first token after the interruption
        self.resumed = False         # resumed from a checkpoint (vs recomputed)
        self.ckpt_tokens = 0         # checkpointed tokens usable at the fault
        self.resident_at_fault = 0.0


class Worker:
    __slots__ = (
        "alive",
        "assisted_by",
        "assisting",
        "chunks",
        "ck_backlog",
        "ck_t",
        "ctx_sum",
        "gain",
        "held",
        "idx",
        "kv_cap",
        "kv_used",
        "node",
        "pending_rate",
        "queue",
        "restoring",
        "run_base",
        "run_inc",
        "run_n",
        "running",
        "speed",
        "state",
        "steps",
        "t0",
        "version",
    )

    def __init__(self, idx: int, node: str, kv_cap: float) -> None:
        self.idx = idx
        self.node = node
        self.kv_cap = kv_cap
        self.alive = True
        self.speed = 1.0
        self.gain = 1.0                  # tokens per sequence per decode step (assist: > 1)
        self.pending_rate: tuple[float, float] | None = None  # speed, gain at the next step
        self.assisting = -1              # target this (recovering) worker drafts for
        self.assisted_by = -1
        self.queue: deque[Req] = deque()  # not fully prefilled, FCFS
        self.running: list[tuple[int, int, Req]] = []  # heap of (end_step, rid, req)
        self.restoring: set[Req] = set()
        self.held: set[Req] = set()      # requests whose checkpoint this worker holds
        self.steps = 0
        self.ctx_sum = 0.0
        self.kv_used = 0.0
        self.state = IDLE
        self.version = 0
        self.t0 = 0.0
        self.run_n = 0
        self.run_base = 0.0
        self.run_inc = 0.0
        self.chunks: list[tuple[Req, int]] = []
        self.ck_backlog = 0.0
        self.ck_t = 0.0

    def run_time(self, n: int) -> float:
        return n * self.run_base + self.run_inc * n * (n - 1) / 2

    def steps_done_by(self, dt: float) -> int:
        """Whole steps of the current run completed `dt` seconds after it started."""
        base, inc = self.run_base, self.run_inc
        if inc <= 0:
            k = int(dt / base)
        else:
            h = base - inc / 2
            k = int((-h + math.sqrt(h * h + 2 * inc * dt)) / inc)
        while k < self.run_n and self.run_time(k + 1) <= dt:
            k += 1
        while k > 0 and self.run_time(k) > dt:
            k -= 1
        return min(k, self.run_n)


@dataclass(slots=True)
class Sample:
    t: float
    waiting: int       # requests not yet fully prefilled, cluster-wide
    outstanding: int   # admitted and not finished


@dataclass(slots=True)
class FaultRecord:
    at: float
    failed: list[int]
    slowed: list[int]
    holder_balance: float | None  # max / mean checkpoint bytes over live holders at the fault


@dataclass(slots=True)
class SimResult:
    requests: list[Req]
    samples: list[Sample]
    fault: FaultRecord | None
    events: int
    end_time: float
    preemptions: int
    assists: list[tuple[int, int]]  # (recovering worker, survivor it drafted for)


class Simulation:
    def __init__(self, workload: Workload, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.pcfg = cfg.policy
        self.cost: CostModel = load_cost_model(cfg.model, cfg.gpu)
        coeff = self.cost.coefficients
        self.a, self.b, self.c, self.d, self.e = coeff.a, coeff.b, coeff.c, coeff.d, coeff.e
        self.kvb = float(self.cost.model.kv_bytes_per_token)
        kv_cap = float(cfg.kv_capacity_tokens or self.cost.kv_capacity_tokens)
        biggest = max((p + o for p, o in zip(workload.prompts, workload.outputs, strict=True)),
                      default=0)
        if biggest > kv_cap:
            raise SimError(f"a request of {biggest} tokens does not fit in a worker's KV cache "
                           f"({int(kv_cap)} tokens)")
        per_node = self.cost.gpu.workers_per_node
        self.workers = [Worker(i, f"node-{i // per_node}", kv_cap) for i in range(cfg.workers)]
        # Live columns of the load snapshot the policy functions read.
        self.col_queue = [0] * cfg.workers
        self.col_held = [0.0] * cfg.workers
        self.col_alive = [True] * cfg.workers
        self.snapshot = policy.LoadSnapshot(
            nodes=[w.node for w in self.workers], ckpt_bytes=self.col_held, queue=self.col_queue,
            budget_bytes=[cfg.budget_bytes] * cfg.workers, alive=self.col_alive,
        )
        self.requests = [Req(i, t, p, o) for i, (t, p, o) in enumerate(
            zip(workload.arrivals, workload.prompts, workload.outputs, strict=True))]
        self.heap: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.events = 0
        self.unfinished = len(self.requests)
        self.orphans: list[Req] = []    # admitted while no worker was alive
        self.samples: list[Sample] = []
        self.fault: FaultRecord | None = None
        self.checkpointing = cfg.policy.checkpoints
        self.preemptions = 0
        self.assists: list[tuple[int, int]] = []
        self.ck_bw = cfg.link_bytes_per_s

    # -- event plumbing ---------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj: object, tag: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, tag))

    def run(self) -> SimResult:
        cfg = self.cfg
        if cfg.fault.kind is not FaultKind.none:
            self._push(cfg.fault.at_s, EV_FAULT, None)
        self._push(0.0, EV_SAMPLE, None)
        reqs, heap = self.requests, self.heap
        n, i = len(reqs), 0
        now = 0.0
        pop = heapq.heappop
        while True:
            next_arrival = reqs[i].arrival if i < n else math.inf
            if heap and heap[0][0] <= next_arrival:
                now, _, kind, obj, tag = pop(heap)
                self.events += 1
                if kind == EV_STEP:
                    w = obj
                    assert isinstance(w, Worker)
                    if tag == w.version:
                        self._step_end(w, now)
                elif kind == EV_SAMPLE:
                    self._sample(now, i < n)
                elif kind == EV_RESTORE:
                    assert isinstance(obj, Req)
                    self._restore_done(obj, tag, now)
                elif kind == EV_FAULT:
                    self._fault(now)
                elif kind == EV_DRAFT:
                    assert isinstance(obj, Worker)
                    self._draft_ready(obj, tag, now)
                elif kind == EV_RELOAD:
                    assert isinstance(obj, Worker)
                    self._reload_done(obj, now)
                elif kind == EV_GRAY_END:
                    assert isinstance(obj, Worker)
                    self._set_rate(obj, now, speed=1.0)
            elif i < n:
                now = next_arrival
                self.events += 1
                self._admit(reqs[i], now)
                i += 1
            else:
                break
        if self.unfinished:
            raise SimError(f"{self.unfinished} requests never finished (simulator bug)")
        return SimResult(self.requests, self.samples, self.fault, self.events, now,
                         self.preemptions, self.assists)

    # -- admission and completion -----------------------------------------------------------

    def _admit(self, r: Req, now: float) -> None:
        target = policy.least_loaded(self.snapshot, self.pcfg)
        if target is None:
            self.orphans.append(r)
            return
        self._place(r, target, now)

    def _place(self, r: Req, target: int, now: float) -> None:
        """Put `r` at the back of `target`'s queue and give it a checkpoint holder."""
        w = self.workers[target]
        r.worker = target
        self.col_queue[target] += 1
        if self.checkpointing:
            self._set_holder(r, target, float(r.prompt + r.generated))
        w.queue.append(r)
        self._poke(w, now)

    def _set_holder(self, r: Req, serving: int, tokens: float) -> None:
        self._drop_holder(r)
        nbytes = tokens * self.kvb
        h = policy.place_checkpoint(self.snapshot, serving, nbytes, self.pcfg)
        if h is not None:
            r.holder = h
            r.hold_bytes = nbytes
            self.col_held[h] += nbytes
            self.workers[h].held.add(r)

    def _drop_holder(self, r: Req) -> None:
        if r.holder >= 0:
            self.col_held[r.holder] -= r.hold_bytes
            self.workers[r.holder].held.discard(r)
            r.holder = -1
            r.hold_bytes = 0.0

    def _finish(self, r: Req, w: Worker, now: float) -> None:
        r.finish = now
        r.completions += 1
        r.generated = r.output
        self.col_queue[w.idx] -= 1
        self._drop_holder(r)
        self.unfinished -= 1

    # -- stepping ---------------------------------------------------------------------------

    def _poke(self, w: Worker, now: float) -> None:
        """New work for `w`: start a step if idle, or end the current run after this step."""
        if w.state == IDLE:
            self._plan(w, now)
        elif w.state == RUN:
            k = w.steps_done_by(now - w.t0)
            if k + 1 < w.run_n:
                w.run_n = k + 1
                w.version += 1
                self._push(w.t0 + w.run_time(w.run_n), EV_STEP, w, w.version)

    def _plan(self, w: Worker, now: float) -> None:
        if w.pending_rate is not None:
            self._apply_rate(w)
        nrun = len(w.running)
        gain = w.gain
        budget = self.cfg.chunk_tokens - nrun
        seqs = nrun
        free = w.kv_cap - w.kv_used - nrun * gain
        chunks: list[tuple[Req, int]] = []
        prefill = 0
        max_batch = self.cfg.max_batch
        for r in w.queue:
            if budget <= 0 or seqs >= max_batch or free < 1:
                break
            take = min(r.todo, budget, int(free))
            chunks.append((r, take))
            budget -= take
            free -= take
            prefill += take
            seqs += 1
        w.t0 = now
        if chunks:
            w.chunks = chunks
            w.state = STEP
            dt = (self.a + self.b * prefill + self.c * prefill * prefill + self.d * nrun
                  + self.e * w.ctx_sum) / w.speed
            if nrun and w.assisted_by >= 0:
                dt += self._assist_extra(w, nrun)
            w.version += 1
            self._push(now + dt, EV_STEP, w, w.version)
            return
        if nrun == 0:
            if w.queue:
                raise SimError(f"worker {w.idx} cannot fit the request at the head of its queue")
            w.state = IDLE
            return
        growth = nrun * gain
        mem_steps = int((w.kv_cap - w.kv_used) / growth)
        if mem_steps < 1:
            self._preempt(w)
            self._plan(w, now)
            return
        n = min(w.running[0][0] - w.steps, mem_steps)
        w.run_n = max(n, 1)
        w.run_base = (self.a + self.d * nrun + self.e * w.ctx_sum) / w.speed
        if w.assisted_by >= 0:
            w.run_base += self._assist_extra(w, nrun)
        w.run_inc = self.e * growth / w.speed
        w.state = RUN
        w.version += 1
        self._push(now + w.run_time(w.run_n), EV_STEP, w, w.version)

    def _step_end(self, w: Worker, now: float) -> None:
        produced = 0.0
        last: float | None = None
        if w.state == STEP:
            nrun = len(w.running)
            if nrun:
                self._advance(w, 1)
                produced += nrun * w.gain
            chunks, w.chunks = w.chunks, []
            queue = w.queue
            for r, take in chunks:
                r.todo -= take
                r.ctx += take
                w.kv_used += take
                produced += take
                if r.todo == 0:
                    queue.popleft()
                    self._emit_first(r, w, now)
        else:  # RUN
            nrun = len(w.running)
            self._advance(w, w.run_n)
            produced += w.run_n * nrun * w.gain
            last = nrun * w.gain
        self._complete_due(w, now)
        if self.checkpointing and produced:
            self._stream(w, now, produced, last)
        w.state = IDLE
        self._plan(w, now)

    def _advance(self, w: Worker, k: int) -> None:
        grow = k * len(w.running) * w.gain
        w.steps += k
        w.ctx_sum += grow
        w.kv_used += grow

    def _complete_due(self, w: Worker, now: float) -> None:
        running = w.running
        while running and running[0][0] <= w.steps:
            _, _, r = heapq.heappop(running)
            ctx = r.ctx_join + (w.steps - r.join_step) * w.gain
            w.ctx_sum -= ctx
            w.kv_used -= ctx
            self._finish(r, w, now)
        if not running:  # clear float drift
            w.ctx_sum = 0.0

    def _emit_first(self, r: Req, w: Worker, now: float) -> None:
        """Prefill done: this step produced the request's next token."""
        if r.first_token < 0:
            r.first_token = now
        if r.interrupted_at >= 0 and r.replay_first < 0:
            r.replay_first = now
        r.generated += 1
        if r.generated >= r.output:
            w.kv_used -= r.ctx
            self._finish(r, w, now)
            return
        r.ctx += 1
        r.join_step = w.steps
        r.ctx_join = r.ctx
        r.gen_join = r.generated
        r.end_step = w.steps + math.ceil((r.output - r.generated) / w.gain)
        w.ctx_sum += r.ctx
        heapq.heappush(w.running, (r.end_step, r.rid, r))

    def _detach_running(self, w: Worker, r: Req) -> None:
        """Take `r` out of the decode batch, fixing its token counts at the current step."""
        k = w.steps - r.join_step
        r.ctx = r.ctx_join + k * w.gain
        r.generated = min(r.output - 1, r.gen_join + int(k * w.gain))
        w.ctx_sum -= r.ctx

    def _preempt(self, w: Worker) -> None:
        """KV is full: evict the most recently joined sequence to be recomputed (vLLM V1)."""
        self.preemptions += 1
        victim = max(w.running, key=lambda item: (item[2].join_step, item[1]))
        w.running.remove(victim)
        heapq.heapify(w.running)
        r = victim[2]
        self._detach_running(w, r)
        w.kv_used -= r.ctx
        r.ctx = 0.0
        r.todo = r.prompt + r.generated
        w.queue.appendleft(r)

    # -- rates: gray failure and draft assist -------------------------------------------------

    def _set_rate(self, w: Worker, now: float, speed: float | None = None,
                  gain: float | None = None) -> None:
        cur = w.pending_rate or (w.speed, w.gain)
        w.pending_rate = (cur[0] if speed is None else speed, cur[1] if gain is None else gain)
        if w.alive:
            self._poke(w, now)

    def _apply_rate(self, w: Worker) -> None:
        """At a step boundary: new speed/gain; re-base decode progress on the new gain."""
        assert w.pending_rate is not None
        speed, gain = w.pending_rate
        w.pending_rate = None
        w.speed = speed
        if gain == w.gain:
            return
        rebased = []
        for _, rid, r in w.running:
            self._detach_running(w, r)
            w.ctx_sum += r.ctx
            r.join_step, r.ctx_join, r.gen_join = w.steps, r.ctx, r.generated
            r.end_step = w.steps + max(1, math.ceil((r.output - r.generated) / gain))
            rebased.append((r.end_step, rid, r))
        heapq.heapify(rebased)
        w.running = rebased
        w.gain = gain

    def _assist_extra(self, w: Worker, nrun: int) -> float:
        """Per-step cost of speculative decoding: verify k more tokens per sequence, and the
        drafter's k steps (on the recovering worker) plus the round trip."""
        k = self.cfg.spec_tokens
        draft = self.cost.draft
        drafting = k * draft.step_time(0, nrun, 0) if draft else 0.0
        return self.b * nrun * k / w.speed + drafting + self.cfg.assist_rtt_s

    # -- checkpoint streaming -----------------------------------------------------------------

    def _stream(self, w: Worker, now: float, tokens: float, last: float | None = None) -> None:
        """`tokens` became resident since the last update, the final `last` of them just now
        (the step that ended). Blocks stream as they fill, so the backlog is what the link
        could not keep up with, and at least the last step's output."""
        sent = self.ck_bw * (now - w.ck_t)
        w.ck_backlog = max(w.ck_backlog + tokens * self.kvb - sent,
                           (tokens if last is None else last) * self.kvb)
        w.ck_t = now

    # -- faults and recovery ------------------------------------------------------------------

    def _fault(self, now: float) -> None:
        spec = self.cfg.fault
        n = len(self.workers)
        if spec.kind is FaultKind.gray:
            w = self.workers[0]
            self._set_rate(w, now, speed=1.0 / spec.slowdown)
            if spec.gray_duration_s is not None:
                self._push(now + spec.gray_duration_s, EV_GRAY_END, w)
            self.fault = FaultRecord(now, [], [0], self._holder_balance())
            return
        if spec.kind is FaultKind.worker:
            failed = [0]
        elif spec.kind is FaultKind.node:
            failed = [w.idx for w in self.workers if w.node == self.workers[0].node]
        elif spec.kind is FaultKind.correlated:
            failed = [0]
            holders = [0] * n
            for w in self.workers:
                for r in w.held:
                    if r.worker == 0:
                        holders[w.idx] += 1
            if max(holders) > 0:
                failed.append(holders.index(max(holders)))
            elif n > 1:
                failed.append(1)
        else:
            k = min(n, max(1, round(spec.fraction * n)))
            failed = sorted(random.Random(self.cfg.seed).sample(range(n), k))
        self.fault = FaultRecord(now, failed, [], self._holder_balance())
        self._fail(failed, now)

    def _holder_balance(self) -> float | None:
        held = [b for b, ok in zip(self.col_held, self.col_alive, strict=True) if ok]
        mean = sum(held) / len(held) if held else 0.0
        return max(held) / mean if mean > 0 else None

    def _fail(self, failed: list[int], now: float) -> None:
        cfg = self.cfg
        interrupted: list[Req] = []
        for idx in failed:
            w = self.workers[idx]
            interrupted.extend(self._stop_worker(w, now))
        # Checkpoints held by the failed workers are gone; requests elsewhere get a new holder.
        for idx in failed:
            for r in list(self.workers[idx].held):
                self._drop_holder(r)
                if r.worker >= 0 and self.col_alive[r.worker] and r.finish < 0:
                    tokens = r.prompt + r.generated
                    self._set_holder(r, r.worker, float(tokens))
                    if r.holder >= 0:
                        self._stream(self.workers[r.worker], now, float(tokens))
        for r in interrupted:
            self._recover(r, now)
        boot = cfg.node_boot_s if cfg.fault.kind is FaultKind.node else 0.0
        reload_at = now + boot + self.cost.load_time(cfg.disk_bytes_per_s, cfg.init_s)
        draft = self.cost.draft
        for idx in failed:
            w = self.workers[idx]
            self._push(reload_at, EV_RELOAD, w)
            if self.pcfg.uses_assist and draft is not None:
                ready = now + boot + draft.load_time(cfg.disk_bytes_per_s, cfg.draft_init_s)
                if ready < reload_at:
                    self._push(ready, EV_DRAFT, w, w.version)

    def _stop_worker(self, w: Worker, now: float) -> list[Req]:
        """Kill `w` at `now`: keep the whole steps it completed, return its requests."""
        if w.state == RUN:
            k = w.steps_done_by(now - w.t0)
            if k:
                self._advance(w, k)
                if self.checkpointing:
                    self._stream(w, now, k * len(w.running) * w.gain, len(w.running) * w.gain)
                self._complete_due(w, now)
        lag_tokens = 0.0
        if self.checkpointing:
            lag_tokens = max(0.0, w.ck_backlog - self.ck_bw * (now - w.ck_t)) / self.kvb
        out: list[Req] = []
        for _, _, r in w.running:
            self._detach_running(w, r)
            out.append(r)
        out.extend(w.queue)
        out.extend(w.restoring)
        protected = [r for r in out if r.holder >= 0 and r.ctx > 0]
        lost_each = lag_tokens / len(protected) if protected else 0.0
        block = self.cfg.block_tokens
        for r in out:
            r.resident_at_fault = r.ctx
            r.ckpt_tokens = 0
            if r.holder >= 0 and r.ctx > 0:
                r.ckpt_tokens = int(max(0.0, r.ctx - lost_each) // block) * block
            if r.first_token >= 0:
                r.interrupted_at = now
                r.replay_first = -1.0
        w.running, w.queue, w.restoring = [], deque(), set()
        w.alive = False
        self.col_alive[w.idx] = False
        self.col_queue[w.idx] = 0
        w.state = IDLE
        w.version += 1
        w.ctx_sum = w.kv_used = w.ck_backlog = 0.0
        if w.assisting >= 0:
            self._stop_assist(w, now)
        if w.assisted_by >= 0:
            self.workers[w.assisted_by].assisting = -1
            w.assisted_by = -1
        return out

    def _recover(self, r: Req, now: float) -> None:
        """Route an interrupted request (Algorithm 2 or a baseline)."""
        r.epoch += 1
        r.worker = -1
        r.resumed = False
        holder = r.holder if r.holder >= 0 and self.col_alive[r.holder] else None
        blocks = r.ckpt_tokens // self.cfg.block_tokens if holder is not None else 0
        route = policy.recover(self.snapshot, holder, blocks, self.pcfg)
        total = r.prompt + r.generated
        r.ctx = 0.0
        if route is None:
            r.todo = total
            self.orphans.append(r)
            return
        if route.resume:
            tokens = min(r.ckpt_tokens, total - 1)  # recompute at least one token
            w = self.workers[route.worker]
            r.worker = route.worker
            r.resumed = True
            r.todo = total - tokens
            r.ctx = float(tokens)
            self.col_queue[w.idx] += 1
            self._set_holder(r, w.idx, float(total))
            if r.holder >= 0:  # the new holder needs the whole context
                self._stream(w, now, float(total))
            w.restoring.add(r)
            self._push(now + tokens * self.kvb / self.cfg.restore_bytes_per_s, EV_RESTORE, r,
                       r.epoch)
            return
        r.todo = total
        self._place(r, route.worker, now)

    def _restore_done(self, r: Req, epoch: int, now: float) -> None:
        if epoch != r.epoch or r.worker < 0:
            return
        w = self.workers[r.worker]
        w.restoring.discard(r)
        if w.kv_used + r.ctx > w.kv_cap:  # no room for the restored pages: recompute
            r.todo += int(r.ctx)
            r.ctx = 0.0
        w.kv_used += r.ctx
        w.queue.append(r)
        self._poke(w, now)

    def _draft_ready(self, w: Worker, version: int, now: float) -> None:
        if w.alive or version != w.version:
            return
        taken = [ok and self.workers[i].assisted_by < 0 for i, ok in enumerate(self.col_alive)]
        target = policy.assist_target(replace(self.snapshot, alive=taken), self.pcfg)
        if target is None:
            return
        t = self.workers[target]
        w.assisting = target
        t.assisted_by = w.idx
        self.assists.append((w.idx, target))
        a, k = self.cfg.spec_acceptance, self.cfg.spec_tokens
        gain = (1 - a ** (k + 1)) / (1 - a)
        self._set_rate(t, now, gain=gain)

    def _stop_assist(self, w: Worker, now: float) -> None:
        t = self.workers[w.assisting]
        w.assisting = -1
        t.assisted_by = -1
        self._set_rate(t, now, gain=1.0)

    def _reload_done(self, w: Worker, now: float) -> None:
        if w.assisting >= 0:
            self._stop_assist(w, now)
        w.alive = True
        self.col_alive[w.idx] = True
        w.speed, w.gain, w.pending_rate = 1.0, 1.0, None
        self.col_held[w.idx] = 0.0
        w.steps = 0
        w.ck_t = now
        orphans, self.orphans = self.orphans, []
        for r in orphans:
            if r.interrupted_at >= 0 or r.epoch > 0:
                self._recover(r, now)
            else:
                self._admit(r, now)

    def _sample(self, now: float, arrivals_left: bool) -> None:
        waiting = sum(len(w.queue) for w in self.workers)
        self.samples.append(Sample(now, waiting, sum(self.col_queue)))
        if arrivals_left or self.unfinished:
            self._push(now + self.cfg.sample_s, EV_SAMPLE, None)


def simulate(workload: Workload, cfg: SimConfig) -> SimResult:
    return Simulation(workload, cfg).run()
