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

Checkpoints: each serving worker's stream is a byte backlog drained at its link bandwidth
(egress), and each holder's incoming stream another one (ingress, shared by every worker that
streams to it; fed by prefill and re-streamed context, the bulk of the bytes). What either
backlog still holds when the server fails is lost, and only whole blocks count. Restores
from one holder share its bandwidth (processor sharing). A full holder evicts by lumend's
eviction policy. Placement and routing call lumend/coordinator/policy.py, exactly as the
coordinator does; the L_hat column is kept up to date per change (`_touch`) so admission and
Algorithm 1 do not recompute every worker.

Faults: the failed engines stop at the fault; the cluster notices after a detection delay
(engine crash: the supervisor's tick; lost host: the etcd lease TTL). Until then the failed
workers still look alive: requests admitted to them wait, checkpoints placed on them are
lost with a lost host. At detection interrupted requests are routed (Algorithm 2), and the
worker comes back from a shadow engine (crash, shadows on) or after reloading its model.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace

from lumend.checkpoint.store import PROTECTED_SHARE
from lumend.coordinator import policy
from lumend.engine.costmodel import CostModel
from lumend.sim.assist import DraftFunction
from lumend.sim.config import FaultKind, SimConfig, cost_policy
from lumend.sim.links import Backlog, SharedLink
from lumend.sim.workload import Workload

IDLE, STEP, RUN = 0, 1, 2
(EV_STEP, EV_FAULT, EV_RESTORE, EV_DRAFT, EV_RELOAD, EV_SAMPLE, EV_GRAY_END,
 EV_DETECT, EV_ASSIST, EV_HEARTBEAT, EV_STALL) = range(11)


class SimError(RuntimeError):
    """A workload or configuration the simulator cannot run (e.g. a request larger than KV)."""


class Req:
    __slots__ = (
        "admitted_to",
        "arrival",
        "ckpt_by",
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
        "hold_t",
        "holders",
        "interrupted_at",
        "join_step",
        "load_bytes",
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
        self.admitted_to = -1        # the worker its first admission chose
        self.holders: list[int] = []  # workers holding a replica of its checkpoint
        self.hold_bytes = 0.0        # charged to each holder
        self.hold_t = 0.0            # when the checkpoint was (re)placed: its age for lru
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
        self.epoch = 0               # bumps on every move, to drop stale restores
        self.interrupted_at = -1.0   # fault time, if its stream was interrupted
        self.replay_first = -1.0     # first token after the interruption
        self.resumed = False         # resumed from a checkpoint (vs recomputed)
        self.ckpt_by: list[tuple[int, int]] = []  # (holder, usable tokens) at the fault
        self.ckpt_tokens = 0         # the best of those
        self.load_bytes = 0.0        # checkpoint bytes to load when next scheduled (resumed)
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
        "decode_steps",
        "drafted",
        "gain",
        "held",
        "idx",
        "ingress",
        "kv_cap",
        "kv_used",
        "lost",
        "node",
        "peak_held",
        "pending_rate",
        "prefill_steps",
        "queue",
        "restores",
        "restoring",
        "run_base",
        "run_inc",
        "run_n",
        "running",
        "rversion",
        "speed",
        "state",
        "steps",
        "t0",
        "version",
    )

    def __init__(self, idx: int, node: str, kv_cap: float, link_bytes_per_s: float,
                 restore_bytes_per_s: float) -> None:
        self.idx = idx
        self.node = node
        self.kv_cap = kv_cap
        self.alive = True                # the engine runs (the snapshot learns at detection)
        self.speed = 1.0
        self.gain = 1.0                  # tokens per sequence per decode step (assist: > 1)
        self.pending_rate: tuple[float, float] | None = None  # speed, gain at the next step
        self.assisting = -1              # target this (recovering) worker drafts for
        self.assisted_by = -1
        self.drafted = False             # the step in flight verifies drafts (assisted)
        self.queue: deque[Req] = deque()  # not fully prefilled, FCFS
        self.running: list[tuple[int, int, Req]] = []  # heap of (end_step, rid, req)
        self.restoring: set[Req] = set()
        self.restores: SharedLink[tuple[Req, int]] = SharedLink(restore_bytes_per_s)
        self.rversion = 0
        self.held: set[Req] = set()      # requests whose checkpoint this worker holds
        self.ingress: Backlog[Req] = Backlog(link_bytes_per_s)
        self.peak_held = 0.0
        self.lost: list[Req] = []        # its requests when its engine failed, until detected
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
        self.prefill_steps = 0           # steps with prefill / decode only, since the last
        self.decode_steps = 0            # assist evaluation (cost-aware assist)

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
    host_lost: bool = False
    detected_at: float | None = None
    back_at: float | None = None  # when the failed workers serve again (shadow or reload)
    # Requests on the failed workers at the fault (running, queued or restoring): the
    # streams a gateway sees break, whether or not they had a first token yet.
    cut_off: int = 0


@dataclass(slots=True)
class SimResult:
    requests: list[Req]
    samples: list[Sample]
    fault: FaultRecord | None
    events: int
    end_time: float
    preemptions: int
    assists: list[tuple[int, int]]  # (recovering worker, survivor it drafted for)
    evictions: int = 0              # checkpoint replicas evicted from full holders
    refused: int = 0                # placements that found no holder (every budget full)
    peak_held: list[float] = field(default_factory=list)  # per worker, bytes
    draft_rounds: int = 0           # assisted sequence-steps (one draft of k tokens each)
    drafted: int = 0                # tokens drafted: draft_rounds * k
    draft_accepted: int = 0         # drafted tokens the targets accepted


class Simulation:
    def __init__(self, workload: Workload, cfg: SimConfig) -> None:
        self.cfg = cfg
        # A cost-aware policy decides with this cluster's costs (seconds, not requests).
        self.pcfg = cost_policy(cfg, cfg.policy) if cfg.policy.cost_aware else cfg.policy
        self.cost: CostModel = cfg.cluster_cost()
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
        n = cfg.workers
        self.workers = [Worker(i, f"node-{i // per_node}", kv_cap, cfg.link_bytes_per_s,
                               cfg.restore_bytes_per_s) for i in range(n)]
        # Live columns of the load snapshot the policy functions read, and L_hat per worker
        # (+inf when dead) kept current by _touch.
        self.col_queue = [0] * n
        self.col_held = [0.0] * n
        self.col_alive = [True] * n
        self.col_load = [0.0] * n
        # Cost-aware policies: the shortest-queue column (admission), seconds of queued work
        # (refreshed when interrupted requests are routed) and predicted assist gains.
        self.cost_aware = cfg.policy.cost_aware
        self.jsq = cfg.policy.admission == "queue"
        self.col_jsq = [0.0] * n
        # Each worker's running + waiting at its last heartbeat (admission_heartbeat_s > 0):
        # the shortest-queue column is max(this, col_queue), as the coordinator's.
        self.col_beat = [0] * n
        # ... as the heartbeats reported it, not yet read by the coordinator
        # (admission_read_phase; col_beat takes them at each read).
        self.beat_reported = [0] * n
        self.col_work = [0.0] * n
        self.col_gain = [0.0] * n
        nodes = tuple(w.node for w in self.workers)
        self.snapshot = policy.LoadSnapshot(
            nodes=nodes, ckpt_bytes=self.col_held, queue=self.col_queue,
            budget_bytes=[cfg.budget_bytes] * n, alive=self.col_alive,
            work_s=self.col_work if self.cost_aware else None,
            assist_gain=self.col_gain if self.cost_aware else None,
        )
        # Where a full holder would evict: the same choice without budgets.
        self.unbudgeted = replace(self.snapshot, budget_bytes=[math.inf] * n)
        self.requests = [Req(i, t, p, o) for i, (t, p, o) in enumerate(
            zip(workload.arrivals, workload.prompts, workload.outputs, strict=True))]
        self.heap: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.events = 0
        self.unfinished = len(self.requests)
        self.orphans: list[Req] = []    # admitted while no worker was alive
        self.samples: list[Sample] = []
        self.fault: FaultRecord | None = None
        self.hung = -1  # the worker whose engine hangs, between the fault and its kill
        self.checkpointing = cfg.policy.checkpoints
        self.replicas = cfg.replicas if self.checkpointing else 0
        # Link backlogs matter only for what a fault loses: tracked until the (one) fault.
        self.track_links = self.checkpointing and cfg.fault.kind not in (FaultKind.none,
                                                                         FaultKind.gray)
        # Algorithm 1 from the kept L_hat column: what place_checkpoint dispatches to here.
        self.fast_holder = (cfg.policy.mode is policy.Mode.lumen
                            and cfg.policy.load_aware_placement and cfg.replicas == 1)
        self.stream_kvb = self.kvb * max(1, self.replicas)  # bytes per token on the wire
        self.preemptions = 0
        self.evictions = 0
        self.refused = 0
        self.assists: list[tuple[int, int]] = []
        self.draft = DraftFunction(cfg.spec_acceptance, cfg.spec_tokens)
        self.draft_rng = random.Random(f"draft-{cfg.seed}")
        self.draft_rounds = 0
        self.draft_accepted = 0
        self.ck_bw = cfg.link_bytes_per_s
        self.chunk_tokens, self.max_batch = cfg.chunk_tokens, cfg.max_batch
        self.kv_preemption = cfg.kv_preemption
        self.prefill_end_decodes = cfg.prefill_end_decodes
        # Eq. 4 weights, for _touch's inline L_hat (tests check it against policy.loads).
        self.alpha, self.beta = self.pcfg.alpha, self.pcfg.beta

    # -- event plumbing ---------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj: object, tag: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, tag))

    def run(self) -> SimResult:
        cfg = self.cfg
        if cfg.fault.kind is not FaultKind.none:
            self._push(cfg.fault.at_s, EV_FAULT, None)
        self._push(0.0, EV_SAMPLE, None)
        beat = cfg.admission_heartbeat_s
        if beat > 0:
            phases = cfg.admission_heartbeat_phases
            for w in self.workers:
                phase = phases[w.idx] if phases else (w.idx + 1) / len(self.workers)
                self._push(beat * phase, EV_HEARTBEAT, w)
            if cfg.admission_read_phase is not None:
                self._push(beat * cfg.admission_read_phase, EV_HEARTBEAT, None)
        reqs, heap = self.requests, self.heap
        n, i = len(reqs), 0
        now = 0.0
        pop = heapq.heappop
        step_end, admit = self._step_end, self._admit
        # A request reaches the scheduler this long after the client sent it (its TTFT
        # counts from the send).
        overhead = cfg.request_overhead_s
        while True:
            next_arrival = reqs[i].arrival + overhead if i < n else math.inf
            if heap and heap[0][0] <= next_arrival:
                now, _, kind, obj, tag = pop(heap)
                self.events += 1
                if kind == EV_STEP:
                    if tag == obj.version:  # type: ignore[attr-defined]
                        step_end(obj, now)  # type: ignore[arg-type]
                elif kind == EV_SAMPLE:
                    self._sample(now, i < n)
                elif kind == EV_RESTORE:
                    assert isinstance(obj, Worker)
                    self._restores_done(obj, tag, now)
                elif kind == EV_FAULT:
                    self._fault(now)
                elif kind == EV_DETECT:
                    assert isinstance(obj, list)
                    self._detect(obj, now)
                elif kind == EV_STALL:
                    self._stall(tag)
                elif kind == EV_DRAFT:
                    assert isinstance(obj, Worker)
                    self._draft_ready(obj, tag, now)
                elif kind == EV_RELOAD:
                    assert isinstance(obj, Worker)
                    self._reload_done(obj, now)
                elif kind == EV_ASSIST:
                    assert isinstance(obj, Worker)
                    self._reassist(obj, tag, now)
                elif kind == EV_GRAY_END:
                    assert isinstance(obj, Worker)
                    self._set_rate(obj, now, speed=1.0)
                elif kind == EV_HEARTBEAT:
                    if obj is None:
                        self._read_heartbeats(now, i < n)
                    else:
                        assert isinstance(obj, Worker)
                        self._heartbeat(obj, now, i < n)
            elif i < n:
                now = next_arrival
                self.events += 1
                admit(reqs[i], now)
                i += 1
            else:
                break
        if self.unfinished:
            raise SimError(f"{self.unfinished} requests never finished (simulator bug)")
        return SimResult(self.requests, self.samples, self.fault, self.events, now,
                         self.preemptions, self.assists, self.evictions, self.refused,
                         [w.peak_held for w in self.workers], self.draft_rounds,
                         self.draft_rounds * self.draft.k, self.draft_accepted)

    # -- admission and completion -----------------------------------------------------------

    def _touch(self, i: int) -> None:
        """Worker i's queue, checkpoint bytes or liveness changed: refresh its L_hat
        (policy.load_hat, inlined: this runs several times per request)."""
        alive = self.col_alive[i]
        self.col_load[i] = (self.alpha * self.col_held[i] + self.beta * self.col_queue[i]
                            if alive else math.inf)
        q, beat = self.col_queue[i], self.col_beat[i]  # max() costs a call, per change
        self.col_jsq[i] = (q if q >= beat else beat) if alive else math.inf

    def _heartbeat(self, w: Worker, now: float, arrivals_left: bool) -> None:
        """Worker w reports its running + waiting (none while it is down: its new engine
        starts empty)."""
        i = w.idx
        if i != self.hung:  # a hung engine's lumend repeats the last load it scraped
            self.beat_reported[i] = self.col_queue[i] if self.col_alive[i] else 0
        if self.cfg.admission_read_phase is None:
            self.col_beat[i] = self.beat_reported[i]
            self._touch(i)
        if arrivals_left or self.unfinished:
            self._push(now + self.cfg.admission_heartbeat_s, EV_HEARTBEAT, w)

    def _read_heartbeats(self, now: float, arrivals_left: bool) -> None:
        """The coordinator reads every worker's last heartbeat (admission_read_phase)."""
        for i, reported in enumerate(self.beat_reported):
            self.col_beat[i] = reported
            self._touch(i)
        if arrivals_left or self.unfinished:
            self._push(now + self.cfg.admission_heartbeat_s, EV_HEARTBEAT, None)

    def _admit(self, r: Req, now: float) -> None:
        target = policy.least_loaded_in(self.col_jsq if self.jsq else self.col_load)
        if target is None:
            self.orphans.append(r)
            return
        self._place(r, target, now)

    def _place(self, r: Req, target: int, now: float) -> None:
        """Put `r` at the back of `target`'s queue and give it checkpoint holders."""
        w = self.workers[target]
        r.worker = target
        if r.admitted_to < 0:
            r.admitted_to = target
        self.col_queue[target] += 1
        self._touch(target)
        if self.checkpointing:
            self._set_holders(r, target, float(r.prompt + r.generated), now, stream=False)
        w.queue.append(r)
        self._poke(w, now)

    def _finish(self, r: Req, w: Worker, now: float) -> None:
        r.finish = now
        r.completions += 1
        r.generated = r.output
        i = w.idx
        self.col_queue[i] -= 1
        self.col_load[i] = self.alpha * self.col_held[i] + self.beta * self.col_queue[i]
        q, beat = self.col_queue[i], self.col_beat[i]
        self.col_jsq[i] = q if q >= beat else beat
        if r.holders:
            self._drop_holders(r)
        self.unfinished -= 1

    # -- checkpoint holders -------------------------------------------------------------------

    def _set_holders(self, r: Req, serving: int, tokens: float, now: float,
                     stream: bool) -> None:
        """(Re)place `r`'s checkpoint for `tokens` of context; `stream`: send that context
        to the new holders now (a resumed or re-protected request)."""
        if r.holders:
            self._drop_holders(r)
        nbytes = tokens * self.kvb
        if self.fast_holder:
            h = policy.choose_holder_in(self.col_load, self.snapshot, serving, nbytes)
            holders = [] if h is None else [h]
        elif self.replicas == 1:
            h = policy.place_checkpoint(self.snapshot, serving, nbytes, self.pcfg)
            holders = [] if h is None else [h]
        else:
            holders = policy.place_checkpoint_replicas(self.snapshot, serving, nbytes,
                                                       self.pcfg, self.replicas)
        if len(holders) < self.replicas and self.cfg.eviction != "refuse":
            holders = self._evict_for(serving, nbytes, holders)
        if not holders:
            self.refused += 1
            return
        r.holders = holders
        r.hold_bytes = nbytes
        r.hold_t = now
        for h in holders:
            self.col_held[h] += nbytes
            w = self.workers[h]
            w.held.add(r)
            if self.col_held[h] > w.peak_held:
                w.peak_held = self.col_held[h]
            self._touch(h)
        if stream and self.track_links:
            self._stream(self.workers[serving], now, nbytes * len(holders))
            for h in holders:
                self.workers[h].ingress.add(now, nbytes, r)

    def _drop_holders(self, r: Req) -> None:
        held, queue, load, alive = self.col_held, self.col_queue, self.col_load, self.col_alive
        for h in r.holders:
            held[h] -= r.hold_bytes
            self.workers[h].held.discard(r)
            load[h] = self.alpha * held[h] + self.beta * queue[h] if alive[h] else math.inf
        r.holders = []
        r.hold_bytes = 0.0

    def _drop_replica(self, r: Req, h: int) -> None:
        self.col_held[h] -= r.hold_bytes
        self.workers[h].held.discard(r)
        self._touch(h)
        r.holders = [x for x in r.holders if x != h]
        if not r.holders:
            r.hold_bytes = 0.0

    def _evict_for(self, serving: int, nbytes: float, holders: list[int]) -> list[int]:
        """Budgets are full: the holders the policy would pick without budgets make room by
        evicting whole checkpoints, as lumend's holder does; refused where they cannot."""
        wanted = policy.place_checkpoint_replicas(self.unbudgeted, serving, nbytes, self.pcfg,
                                                  self.replicas)
        out = list(holders)
        for h in wanted:
            if len(out) >= self.replicas:
                break
            if h not in out and self._make_room(h, nbytes):
                out.append(h)
        return out

    def _make_room(self, h: int, nbytes: float) -> bool:
        budget = self.snapshot.budget_bytes[h]
        if self.col_held[h] + nbytes <= budget:
            return True
        victims = self._victims(self.workers[h])
        # Evict nothing when even every candidate would not make room (lumend's rule).
        if sum(v.hold_bytes for v in victims) < self.col_held[h] + nbytes - budget:
            return False
        for v in victims:
            if self.col_held[h] + nbytes <= budget:
                break
            self._drop_replica(v, h)
            self.evictions += 1
        return True

    def _victims(self, w: Worker) -> list[Req]:
        """w's checkpoints in eviction order. lru: the oldest placement first (a decoding
        request writes every step, so its last write is now; age is what separates them)."""
        if self.cfg.eviction == "lru":
            return sorted(w.held, key=lambda r: (r.hold_t, r.rid))
        by_length = sorted(w.held, key=lambda r: (r.hold_bytes, r.hold_t, r.rid))
        if self.cfg.eviction == "longest_prefix_protected" and by_length:
            protected = max(1, math.ceil(len(by_length) * PROTECTED_SHARE))
            return by_length[:-protected]
        return by_length

    # -- stepping ---------------------------------------------------------------------------

    def _poke(self, w: Worker, now: float) -> None:
        """New work for `w`: start a step if idle, or end the current run after this step."""
        if w.state == IDLE:
            if w.alive:
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
        budget = self.cfg.prefill_budget(nrun)
        seqs = nrun
        free = w.kv_cap - w.kv_used - (nrun * gain if self.kv_preemption else 0.0)
        chunks: list[tuple[Req, int]] = []
        prefill = 0
        load = 0.0
        max_batch = self.max_batch
        engine_rule = not self.kv_preemption
        if engine_rule:
            free_blocks = self._free_blocks(w)
        ending = ending_ctx = 0.0  # prompts whose last chunk this step runs, their context
        for r in w.queue:
            if budget <= 0 or seqs >= max_batch:
                break
            if engine_rule and not r.load_bytes:
                # The sim engine's rule: a prompt is admitted once all of its blocks and
                # one more are free (counted per sequence, in whole blocks, its unprefilled
                # rest included); an admitted one then prefills whatever the KV holds.
                if r.ctx == 0:
                    need = -(-r.todo // self.cfg.block_tokens)
                    if need + 1 > free_blocks:
                        break
                    free_blocks -= need
                take = min(r.todo, budget)
            else:
                if free < 1:
                    break
                if r.load_bytes:
                    # A resumed request's pages load inside the step that schedules it (the
                    # connector's start_load_kv is synchronous): the whole batch waits.
                    if r.ctx + 1 > free:  # no room for its pages: recompute them instead
                        r.todo += int(r.ctx)
                        r.ctx = 0.0
                    else:
                        load += r.load_bytes
                        free -= r.ctx
                        w.kv_used += r.ctx
                    r.load_bytes = 0.0
                take = min(r.todo, budget, int(free))
                free -= take
            chunks.append((r, take))
            budget -= take
            prefill += take
            seqs += 1
            if take == r.todo:
                ending += 1
                ending_ctx += r.ctx + take
        w.t0 = now
        if chunks:
            w.chunks = chunks
            w.state = STEP
            if not self.prefill_end_decodes:
                ending = ending_ctx = 0.0
            dt = (self.a + self.b * prefill + self.c * prefill * prefill
                  + self.d * (nrun + ending) + self.e * (w.ctx_sum + ending_ctx)) / w.speed
            if load:
                dt += load / self.cfg.restore_bytes_per_s
            if nrun and w.assisted_by >= 0:
                dt += self._assist_extra(w, nrun)
                w.drafted = True
            w.version += 1
            self.seq += 1
            heapq.heappush(self.heap, (now + dt, self.seq, EV_STEP, w, w.version))
            return
        if nrun == 0:
            if w.queue:
                raise SimError(f"worker {w.idx} cannot fit the request at the head of its queue")
            w.state = IDLE
            return
        growth = nrun * gain
        n = w.running[0][0] - w.steps
        if self.kv_preemption:
            mem_steps = int((w.kv_cap - w.kv_used) / growth)
            if mem_steps < 1:
                self._preempt(w)
                self._plan(w, now)
                return
            if n > mem_steps:
                n = mem_steps
        w.run_n = n if n > 1 else 1
        w.run_base = (self.a + self.d * nrun + self.e * w.ctx_sum) / w.speed
        if w.assisted_by >= 0:
            w.run_base += self._assist_extra(w, nrun)
            w.drafted = True
        w.run_inc = self.e * growth / w.speed
        w.state = RUN
        w.version += 1
        self.seq += 1
        heapq.heappush(self.heap, (now + w.run_time(w.run_n), self.seq, EV_STEP, w, w.version))

    def _step_end(self, w: Worker, now: float) -> None:
        produced = 0.0
        last: float | None = None
        if w.drafted:
            self._verify_drafts(w, len(w.running) * (1 if w.state == STEP else w.run_n))
        if w.state == STEP:
            w.prefill_steps += 1
            nrun = len(w.running)
            if nrun:
                self._advance(w, 1)
                produced += nrun * w.gain
            chunks, w.chunks = w.chunks, []
            queue = w.queue
            workers, kvb, track = self.workers, self.kvb, self.track_links
            for r, take in chunks:
                r.todo -= take
                r.ctx += take
                w.kv_used += take
                produced += take
                if track:
                    # Prefill pages (most of a checkpoint's bytes) queue at holders' ingress.
                    for h in r.holders:
                        workers[h].ingress.add(now, take * kvb, r)
                if r.todo == 0:
                    queue.popleft()
                    self._emit_first(r, w, now)
        else:  # RUN
            nrun = len(w.running)
            w.decode_steps += w.run_n
            self._advance(w, w.run_n)
            produced += w.run_n * nrun * w.gain
            last = nrun * w.gain * self.stream_kvb
        running = w.running
        if not running or running[0][0] <= w.steps:
            self._complete_due(w, now)
        if self.track_links and produced:
            self._stream(w, now, produced * self.stream_kvb, last)
        w.state = IDLE
        self._plan(w, now)

    def _free_blocks(self, w: Worker) -> int:
        """KV blocks free by the sim engine's count: the pool less every admitted
        sequence's context in whole blocks, a prefilling one's whole prompt included."""
        block = self.cfg.block_tokens
        steps, gain = w.steps, w.gain
        used = sum(-(-int(r.ctx_join + (steps - r.join_step) * gain) // block)
                   for _, _, r in w.running)
        used += sum(-(-int(r.ctx + r.todo) // block) for r in w.queue if r.ctx > 0)
        return int(w.kv_cap) // block - used

    def _advance(self, w: Worker, k: int) -> None:
        grow = k * len(w.running) * w.gain
        w.steps += k
        w.ctx_sum += grow
        w.kv_used += grow

    def _complete_due(self, w: Worker, now: float) -> None:
        running = w.running
        if running and running[0][0] > w.steps:
            return
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

    def _verify_drafts(self, w: Worker, rounds: int) -> None:
        """The assisted steps that just ended verified `rounds` drafts: sample how many
        drafted tokens the target kept."""
        w.drafted = False
        self.draft_rounds += rounds
        self.draft_accepted += self.draft.accepted(self.draft_rng, rounds)

    def _assist_extra(self, w: Worker, nrun: int) -> float:
        """Per-step cost of speculative decoding: verify k more tokens per sequence, and the
        drafter's k steps (on the recovering worker) plus the round trip."""
        k = self.cfg.spec_tokens
        draft = self.cost.draft
        drafting = k * draft.step_time(0, nrun, 0) if draft else 0.0
        return self.b * nrun * k / w.speed + drafting + self.cfg.assist_rtt_s

    # -- checkpoint streaming -----------------------------------------------------------------


    def _stream(self, w: Worker, now: float, nbytes: float, last: float | None = None) -> None:
        """`nbytes` became resident (on the wire: every replica's copy) since the last update,
        the final `last` bytes of them just now (the step that ended). Blocks stream as they
        fill, so the backlog is what w's link could not keep up with, and at least the last
        step's output."""
        sent = self.ck_bw * (now - w.ck_t)
        w.ck_backlog = max(w.ck_backlog + nbytes - sent, nbytes if last is None else last)
        w.ck_t = now

    # -- faults -------------------------------------------------------------------------------

    def _fault(self, now: float) -> None:
        spec = self.cfg.fault
        n = len(self.workers)
        hit = spec.worker
        if spec.kind is FaultKind.gray:
            w = self.workers[hit]
            self._set_rate(w, now, speed=1.0 / spec.slowdown)
            if spec.gray_duration_s is not None:
                self._push(now + spec.gray_duration_s, EV_GRAY_END, w)
            self.fault = FaultRecord(now, [], [hit], self._holder_balance())
            return
        if spec.kind in (FaultKind.worker, FaultKind.hang):
            failed = [hit]
        elif spec.kind is FaultKind.node:
            failed = [w.idx for w in self.workers if w.node == self.workers[hit].node]
        elif spec.kind is FaultKind.correlated:
            failed = [hit]
            holders = [0] * n
            for w in self.workers:
                for r in w.held:
                    if r.worker == hit:
                        holders[w.idx] += 1
            if max(holders) > 0:
                failed.append(holders.index(max(holders)))
            elif n > 1:
                failed.append((hit + 1) % n)
        else:
            k = min(n, max(1, round(spec.fraction * n)))
            failed = sorted(random.Random(self.cfg.seed).sample(range(n), k))
        host_lost = spec.kind.host_lost
        self.fault = FaultRecord(now, failed, [], self._holder_balance(), host_lost)
        egress_lost: dict[Req, float] = {}
        interrupted: list[Req] = []
        for idx in failed:
            w = self.workers[idx]
            out, lost_each = self._stop_worker(w, now)
            w.lost = out
            interrupted.extend(out)
            for r in out:
                egress_lost[r] = lost_each
        self.fault.cut_off = len(interrupted)
        self._checkpoint_at_fault(interrupted, egress_lost, set(failed) if host_lost else set(),
                                  now)
        self.track_links = False
        if spec.kind is FaultKind.hang:
            # Frozen where it stood: its streams stall, and it is still admitted to, on the
            # load its lumend last reported, until it is taken as stalled; killed later.
            self.hung = hit
            delay = self.cfg.hang_detect_s
            if self.cfg.hang_stall_s < delay:
                self._push(now + self.cfg.hang_stall_s, EV_STALL, None, hit)
        else:
            delay = self.cfg.host_detect_s if host_lost else self.cfg.crash_detect_s
        self._push(now + delay, EV_DETECT, failed)

    def _stall(self, idx: int) -> None:
        """The hung worker is stalled: no admission, no new checkpoint there (what it has
        waits for the kill)."""
        if idx == self.hung:
            self.col_alive[idx] = False
            self._touch(idx)

    def _checkpoint_at_fault(self, interrupted: list[Req], egress_lost: dict[Req, float],
                             dead_hosts: set[int], now: float) -> None:
        """What each interrupted request's replicas hold: resident context minus the bytes
        still queued at the server's link or the holder's (a byte is safe once both carried
        it; the larger backlog stands for the tandem), in whole blocks; nothing on a lost
        host."""
        needed = {h for r in interrupted for h in r.holders if h not in dead_hosts}
        pending = {h: self.workers[h].ingress.pending(now) for h in needed}
        block = self.cfg.block_tokens
        for r in interrupted:
            r.resident_at_fault = r.ctx
            r.ckpt_by = []
            best = 0
            if r.ctx > 0:
                for h in r.holders:
                    if h in dead_hosts:
                        continue
                    lost = max(egress_lost[r], pending[h].get(r, 0.0)) / self.kvb
                    tokens = int(max(0.0, r.ctx - lost) // block) * block
                    r.ckpt_by.append((h, tokens))
                    best = max(best, tokens)
            r.ckpt_tokens = best
            if r.first_token >= 0:
                r.interrupted_at = now
                r.replay_first = -1.0

    def _holder_balance(self) -> float | None:
        held = [b for b, ok in zip(self.col_held, self.col_alive, strict=True) if ok]
        mean = sum(held) / len(held) if held else 0.0
        return max(held) / mean if mean > 0 else None

    def _stop_worker(self, w: Worker, now: float) -> tuple[list[Req], float]:
        """Kill `w`'s engine at `now`: keep the whole steps it completed. Returns its requests
        and the bytes of each one's checkpoint still in w's outgoing link."""
        if w.state == RUN:
            k = w.steps_done_by(now - w.t0)
            if k:
                if w.drafted:
                    self._verify_drafts(w, k * len(w.running))
                self._advance(w, k)
                if self.track_links:
                    produced = len(w.running) * w.gain * self.stream_kvb
                    self._stream(w, now, k * produced, produced)
                self._complete_due(w, now)
        lag = 0.0
        if self.track_links:
            lag = max(0.0, w.ck_backlog - self.ck_bw * (now - w.ck_t))
        out: list[Req] = []
        for _, _, r in w.running:
            self._detach_running(w, r)
            out.append(r)
        out.extend(w.queue)
        out.extend(w.restoring)
        protected = sum(1 for r in out if r.holders and r.ctx > 0)
        lost_each = lag / (protected * max(1, self.replicas)) if protected else 0.0
        w.running, w.queue, w.restoring = [], deque(), set()
        w.restores.clear()
        w.rversion += 1
        w.alive = False
        w.state = IDLE
        w.version += 1
        w.ctx_sum = w.kv_used = w.ck_backlog = 0.0
        w.drafted = False  # its step in flight never ends
        if w.assisting >= 0:
            self._stop_assist(w, now)
        if w.assisted_by >= 0:
            self.workers[w.assisted_by].assisting = -1
            w.assisted_by = -1
        return out, lost_each

    def _detect(self, failed: list[int], now: float) -> None:
        """The cluster learns of the failure: route the failed workers' requests (those cut
        off at the fault and those admitted since), re-protect checkpoints a lost host took,
        and start the way back (shadow or reload)."""
        assert self.fault is not None
        cfg = self.cfg
        host_lost = self.fault.host_lost
        self.fault.detected_at = now
        moved: list[Req] = []
        for idx in failed:
            w = self.workers[idx]
            if idx == self.hung:
                # What it was given while hung was never read by the engine: the gateways
                # find it refused at the kill and admit it again (not a cut-off stream).
                self.hung = -1
            self.col_alive[idx] = False
            self.col_queue[idx] = self.col_beat[idx] = self.beat_reported[idx] = 0
            self._touch(idx)
            # Those admitted after the fault, which the engine never read, first: the
            # gateways find them refused and admit them again a few milliseconds before the
            # broken streams' recoveries reach a survivor (the validation's hung-engine
            # runs: the refused requests' first tokens came first on the survivor).
            moved.extend(w.queue)
            moved.extend(w.lost)
            w.lost, w.queue = [], deque()
        if host_lost:
            exposed: dict[int, Req] = {}
            for idx in failed:
                w = self.workers[idx]
                for r in list(w.held):
                    self._drop_replica(r, idx)
                    exposed[r.rid] = r
                w.ingress.clear()
            for r in exposed.values():
                if r.worker >= 0 and self.col_alive[r.worker] and r.finish < 0:
                    self._set_holders(r, r.worker, float(r.prompt + r.generated), now,
                                      stream=True)
        self._refresh_work()
        for r in moved:
            self._recover(r, now)
        # The way back starts when the engine is gone: at the fault, or at a hung one's kill.
        at = now if cfg.fault.kind is FaultKind.hang else self.fault.at
        if cfg.shadows and not host_lost:
            back = max(now, at + cfg.shadow_takeover_s)
        else:
            boot = cfg.node_boot_s if cfg.fault.kind is FaultKind.node else 0.0
            reload_s = (cfg.reload_s if cfg.reload_s is not None
                        else self.cost.load_time(cfg.reload_bytes_per_s, cfg.init_s))
            back = max(now, at + boot + reload_s)
            draft = self.cost.draft
            if self.pcfg.uses_assist and draft is not None:
                ready = max(now, at + boot + draft.load_time(cfg.reload_bytes_per_s,
                                                             cfg.draft_init_s))
                if ready < back:
                    for idx in failed:
                        self._push(ready, EV_DRAFT, self.workers[idx], self.workers[idx].version)
        self.fault.back_at = back
        for idx in failed:
            self._push(back, EV_RELOAD, self.workers[idx])

    # -- recovery -----------------------------------------------------------------------------

    def _recover(self, r: Req, now: float) -> None:
        """Route a request off a failed worker (Algorithm 2 or a baseline)."""
        r.epoch += 1
        r.worker = -1
        r.resumed = False
        usable = dict((h, t) for h, t in r.ckpt_by if t > 0)
        holder = policy.choose_replica(self.snapshot, list(usable), self.pcfg) if usable else None
        blocks = usable[holder] // self.cfg.block_tokens if holder is not None else 0
        total = r.prompt + r.generated
        route = policy.recover(self.snapshot, holder, blocks, self.pcfg, total)
        r.ctx = 0.0
        if route is None:
            r.todo = total
            self.orphans.append(r)
            return
        if route.resume:
            tokens = min(usable[route.worker], total - 1)  # recompute at least one token
            w = self.workers[route.worker]
            r.worker = w.idx
            r.resumed = True
            r.todo = total - tokens
            r.ctx = float(tokens)
            self.col_queue[w.idx] += 1
            self._touch(w.idx)
            if self.cost_aware:
                self.col_work[w.idx] += (policy.restore_s(tokens, self.pcfg)
                                         + policy.recompute_s(total - tokens, self.pcfg))
            # It now runs on its holder: the checkpoint moves to new holders, whole context.
            self._set_holders(r, w.idx, float(total), now, stream=True)
            if self.cfg.restore_async:
                w.restoring.add(r)
                w.restores.add(now, tokens * self.kvb, (r, r.epoch))
                self._schedule_restores(w)
            else:
                r.load_bytes = tokens * self.kvb
                w.queue.append(r)
                self._poke(w, now)
            return
        r.todo = total
        if self.cost_aware:
            self.col_work[route.worker] += policy.recompute_s(total, self.pcfg)
        self._place(r, route.worker, now)

    def _refresh_work(self) -> None:
        """Seconds of queued work per worker (cost-aware routing): its queued prefill at
        the per-token cost of a step beside its decode batch, plus pending page loads."""
        if not self.cost_aware:
            return
        bw = self.cfg.restore_bytes_per_s
        for w in self.workers:
            todo = 0
            load = 0.0
            for r in w.queue:
                todo += r.todo
                load += r.load_bytes
            load += sum(r.ctx for r in w.restoring) * self.kvb
            nrun = len(w.running)
            p = max(1, self.cfg.prefill_budget(nrun))
            per_token = self.cost.step_time(p, nrun, w.ctx_sum) / p / w.speed
            self.col_work[w.idx] = todo * per_token + load / bw

    def _refresh_gains(self) -> None:
        """Predicted gain of draft-assisting each live worker (policy.assist_gain), from its
        current batch and queue."""
        tpr = self.draft.tokens_per_round()
        for w in self.workers:
            nrun = len(w.running)
            steps = w.prefill_steps + w.decode_steps
            share = w.prefill_steps / steps if steps else 0.0
            w.prefill_steps = w.decode_steps = 0
            if not w.alive or nrun == 0:
                self.col_gain[w.idx] = -math.inf
                continue
            todo = sum(r.todo for r in w.queue)
            head = w.queue[0].todo if w.queue else 0
            bound = bool(todo) and (nrun >= self.max_batch
                                    or w.kv_cap - w.kv_used - nrun < min(head, 1))
            p = min(todo, max(0, self.cfg.prefill_budget(nrun)))
            step = self.cost.step_time(p, nrun, w.ctx_sum) / w.speed
            self.col_gain[w.idx] = policy.assist_gain(
                step, self._assist_extra(w, nrun), tpr, prefill_waiting=todo > 0,
                capacity_bound=bound, prefill_share=share,
                objective=self.cfg.policy.assist_objective)

    def _schedule_restores(self, w: Worker) -> None:
        at = w.restores.next_done_at()
        if at is not None:
            w.rversion += 1
            self._push(at, EV_RESTORE, w, w.rversion)

    def _restores_done(self, w: Worker, version: int, now: float) -> None:
        if version != w.rversion:
            return
        for r, epoch in w.restores.done(now):
            if epoch == r.epoch and r.worker == w.idx:
                self._restore_done(r, w, now)
        self._schedule_restores(w)

    def _restore_done(self, r: Req, w: Worker, now: float) -> None:
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
        if self.cost_aware:
            # Re-evaluated every assist_eval_s while the worker reloads (_reassist).
            self._push(now + self.cfg.assist_eval_s, EV_ASSIST, w, w.version)
            self._refresh_gains()
        taken = [ok and self.workers[i].assisted_by < 0 for i, ok in enumerate(self.col_alive)]
        target = policy.assist_target(replace(self.snapshot, alive=taken), self.pcfg)
        if target is None:
            return
        self._start_assist(w, target, now)

    def _reassist(self, w: Worker, version: int, now: float) -> None:
        """Cost-aware assist, re-evaluated: stop where the predicted gain is no longer
        positive, and assist the survivor with the highest positive gain."""
        if w.alive or version != w.version:
            return
        self._push(now + self.cfg.assist_eval_s, EV_ASSIST, w, w.version)
        self._refresh_gains()
        if w.assisting >= 0:
            if self.col_gain[w.assisting] > 0:
                return
            self._stop_assist(w, now)
        taken = [ok and self.workers[i].assisted_by < 0 for i, ok in enumerate(self.col_alive)]
        target = policy.assist_target(replace(self.snapshot, alive=taken), self.pcfg)
        if target is not None:
            self._start_assist(w, target, now)

    def _start_assist(self, w: Worker, target: int, now: float) -> None:
        t = self.workers[target]
        w.assisting = target
        t.assisted_by = w.idx
        self.assists.append((w.idx, target))
        self._set_rate(t, now, gain=self.draft.tokens_per_round())

    def _stop_assist(self, w: Worker, now: float) -> None:
        t = self.workers[w.assisting]
        w.assisting = -1
        t.assisted_by = -1
        self._set_rate(t, now, gain=1.0)

    def _reload_done(self, w: Worker, now: float) -> None:
        """w serves again (a shadow took over, or the model reloaded): empty KV, same host."""
        if w.assisting >= 0:
            self._stop_assist(w, now)
        w.alive = True
        self.col_alive[w.idx] = True
        w.speed, w.gain, w.pending_rate = 1.0, 1.0, None
        self.col_held[w.idx] = math.fsum(r.hold_bytes for r in w.held)  # clear float drift
        self._touch(w.idx)
        w.steps = 0
        w.ck_t = now
        orphans, self.orphans = self.orphans, []
        self._refresh_work()
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
