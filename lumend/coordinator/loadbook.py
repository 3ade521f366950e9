"""The coordinator's load book: what it admitted and what holders report, counted per change.

One job: keep the inputs of Algorithms 1-3 current so that a decision reads them instead of
rescanning every request in flight and every checkpoint held. Per change (admit, finish,
recover, progress) the work is O(1), plus O(log W) to re-rank a worker whose queue or bytes
moved; per view (one per HA cycle) it is O(workers) plus the entries that expire. An
admission reads rankings (lumend.coordinator.ranking) instead of building its two tables:
`least_loaded` takes the first ranked worker its mask lets through, `holder` walks the
workers ranked by L_hat from the least loaded and stops at the first whose lower bound is
above the best value found (about 10 of 64 workers in a steady burst), with the very
values and tie-breaks of the policy's scans over `table` and `holders_table` (kept: the
other decisions and the uncommon cases of Algorithm 1 still use them). Neither grows with
the requests in flight.

What it keeps, and the column a decision reads:
* requests admitted (or recovered) here and not finished, by id; per serving worker their
  count; per (serving worker, holder) the checkpoints placed (the holder table's spread);
  per checkpoint id how many requests carry it (whether a progress report is ours);
* bytes reported per checkpoint and their sum per holder; per holder the checkpoints placed
  there that no report names yet, which the holders' table counts at the mean reported size
  (a burst outruns the reports: a holder's pages stream only after the prefill, and without
  them the holders that tie on the queue would take every checkpoint until reports land);
* per view: workers in name order, the heartbeat's queue and bytes, eligibility, budgets,
  nodes, the policy config, and the two live columns `queue = max(heartbeat, count here)`
  and `ckpt = max(heartbeat bytes, bytes reported)`, updated in place per change; with
  cost-aware decisions a third, `work` (seconds of queued prefill, `LoadSnapshot.work_s`,
  `policy.queued_prefill_s`): beta x the requests not yet running, `queue - heartbeat
  running` (requests admitted since the last heartbeat count as waiting).

Entries leave on Finish, and also expire (issue 14 item 6): when the node whose gateway
admitted them is gone from the view or restarted (another `started_at`), and after
`REQUEST_TTL_S` in any case (a Finish lost with a failed call).
"""

from __future__ import annotations

import math
import operator
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lumend.cluster.models import WorkerRecord
from lumend.cluster.view import ClusterView
from lumend.coordinator.policy import (
    LoadSnapshot,
    Mode,
    PolicyConfig,
    l_hat,
    load_hat,
    place_checkpoint,
    queued_prefill_s,
)
from lumend.coordinator.ranking import Ranking, first_alive
from lumend.coordinator.settings import policy_config
from lumend.rpc.messages import CheckpointProgress, CheckpointRef, Target

# A request admitted and never finished is forgotten after this long (no stream lasts an
# hour; a Finish lost with its call would otherwise count against its worker forever).
REQUEST_TTL_S = 3600.0
# Expiry is by buckets of admission time: O(expired entries) per view, no scan.
BUCKET_S = 60.0
# What a checkpoint placed and not yet reported weighs in its holder's bytes before any
# checkpoint was reported (then: the mean reported checkpoint): a prompt's first pages.
UNREPORTED_BYTES = 16 << 20


@dataclass
class Admitted:
    worker: str  # "" while its recovery is being decided or found no survivor
    checkpoint: CheckpointRef | None
    gateway: str
    at: float = 0.0  # when it entered the book (the book's clock)
    # The gateway's node `started_at` at admission; None: the gateway is not a node of the
    # view (then only the TTL expires it).
    gateway_started: float | None = None


@dataclass
class Held:
    holder: str
    bytes: int
    tokens: int


def target_of(worker: WorkerRecord) -> Target:
    active = [e.url for e in worker.engines if e.role == "active"]
    others = [e.url for e in worker.engines if e.role != "active"]
    return Target(worker.name, worker.node, worker.model, (*active, *others))


@dataclass
class Columns:
    """One view's workers in name order and the columns decisions read over them."""

    view: ClusterView
    workers: list[WorkerRecord]
    index: dict[str, int]
    nodes: tuple[str, ...]
    budget: tuple[float, ...]
    eligible: tuple[bool, ...]
    hb_queue: list[int]
    hb_running: list[int]
    hb_bytes: list[int]
    held: list[int]  # live: bytes reported here
    unreported: list[int]  # live: checkpoints placed here that no report names yet
    queue: list[int]  # live: max(heartbeat running + waiting, admitted here)
    ckpt: list[float]  # live: float(max(heartbeat bytes held, bytes reported here))
    cfg: PolicyConfig
    # live, cost-aware only: beta * (queue - heartbeat running), seconds of queued prefill
    work: list[float] | None = None
    # live, built on first use: per serving worker, its checkpoints placed on each worker
    spread: dict[str, list[int]] = field(default_factory=dict)
    # live, built on first use: the eligible workers ranked by the admission's key (queue,
    # or L_hat) and by L_hat (the holders' lower bound; the same ranking when admission is
    # by L_hat); marked per change of a key's inputs
    admit_rank: Ranking | None = None
    holder_rank: Ranking | None = None
    _by_model: dict[str | None, tuple[bool, ...]] = field(default_factory=dict)
    _targets: dict[int, Target] = field(default_factory=dict)
    _endpoints: dict[int, str] = field(default_factory=dict)

    def serving(self, model: str | None) -> tuple[bool, ...]:
        """Eligible workers of `model` (None or "": any)."""
        alive = self._by_model.get(model)
        if alive is None:
            alive = self.eligible if not model else tuple(
                ok and w.model == model for ok, w in zip(self.eligible, self.workers,
                                                         strict=True))
            self._by_model[model] = alive
        return alive

    def mark(self, i: int) -> None:
        """Worker `i`'s queue or bytes changed: re-rank it before the next decision."""
        if self.admit_rank is not None:
            self.admit_rank.mark(i)
        if self.holder_rank is not None and self.holder_rank is not self.admit_rank:
            self.holder_rank.mark(i)

    def endpoint(self, i: int) -> str:
        """Where checkpoints held by worker `i` are sent: its node's holder."""
        e = self._endpoints.get(i)
        if e is None:
            e = self._endpoints[i] = ("tcp://" +
                                      self.view.nodes[self.workers[i].node].checkpoint)
        return e

    def target(self, i: int) -> Target:
        t = self._targets.get(i)
        if t is None:
            t = self._targets[i] = target_of(self.workers[i])
        return t


@dataclass(frozen=True)
class Table:
    """One decision's inputs: workers in name order and the load snapshot over them."""

    workers: list[WorkerRecord]
    snapshot: LoadSnapshot
    cfg: PolicyConfig
    _index: dict[str, int]

    def index(self, name: str | None) -> int | None:
        return None if name is None else self._index.get(name)

    def load(self, i: int) -> float:
        return load_hat(self.snapshot, i, self.cfg)


class LoadBook:
    def __init__(self, eligible: Callable[[ClusterView, WorkerRecord], bool], *,
                 ttl_s: float = REQUEST_TTL_S, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._eligible = eligible
        self._ttl_s = ttl_s
        self._clock = clock
        self.requests: dict[str, Admitted] = {}
        self.held: dict[str, Held] = {}  # ckpt id -> what its holder reported
        self._queued: Counter[str] = Counter()  # serving worker -> requests here
        self._held_bytes: Counter[str] = Counter()  # holder -> bytes reported
        self._held_total = 0  # their sum
        self._spread: dict[str, Counter[str]] = {}  # serving worker -> holder -> checkpoints
        self._placed: Counter[str] = Counter()  # ckpt id -> requests carrying it
        self._placed_on: dict[str, str] = {}  # ckpt id -> the holder it was placed on
        # holder -> checkpoints placed there that no report names yet (a burst outruns
        # the reports: the holders' table counts them at the mean reported size)
        self._unreported: Counter[str] = Counter()
        self._by_gateway: dict[tuple[str, float], set[str]] = {}
        self._buckets: dict[int, set[str]] = {}
        self._cols: Columns | None = None
        self.expired: Counter[str] = Counter()  # entries forgotten without Finish, by why

    # -- requests -----------------------------------------------------------------------

    def admit(self, request_id: str, worker: str, checkpoint: CheckpointRef | None,
              gateway: str, view: ClusterView | None = None) -> Admitted:
        """Record a request served by `worker` (replacing an entry of the same id)."""
        if request_id in self.requests:
            self.finish(request_id)
        node = view.nodes.get(gateway) if view is not None and gateway else None
        entry = Admitted(worker, checkpoint, gateway, self._clock(),
                         node.started_at if node is not None else None)
        self.requests[request_id] = entry
        self._count(entry, 1)
        if entry.gateway_started is not None:
            self._by_gateway.setdefault((gateway, entry.gateway_started), set()).add(request_id)
        self._buckets.setdefault(self._bucket(entry.at), set()).add(request_id)
        return entry

    def finish(self, request_id: str) -> Admitted | None:
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return None
        self._count(entry, -1)
        if entry.gateway_started is not None:
            key = (entry.gateway, entry.gateway_started)
            ids = self._by_gateway.get(key)
            if ids is not None:
                ids.discard(request_id)
                if not ids:
                    del self._by_gateway[key]
        bucket = self._bucket(entry.at)
        ids = self._buckets.get(bucket)
        if ids is not None:
            ids.discard(request_id)
            if not ids:
                del self._buckets[bucket]
        return entry

    def unassign(self, request_id: str) -> Admitted | None:
        """The request leaves its worker's queue (its recovery is being decided)."""
        entry = self.requests.get(request_id)
        if entry is not None and entry.worker:
            self._count(entry, -1)
            entry.worker = ""
            self._count(entry, 1)
        return entry

    def _count(self, entry: Admitted, delta: int) -> None:
        worker = entry.worker
        cols = self._cols
        if worker:
            n = self._queued[worker] + delta
            if n:
                self._queued[worker] = n
            else:
                del self._queued[worker]
            i = None if cols is None else cols.index.get(worker)
            if cols is not None and i is not None:
                q = cols.queue[i] = max(cols.hb_queue[i], n)
                if cols.work is not None:
                    cols.work[i] = queued_prefill_s(q, cols.hb_running[i], cols.cfg)
                cols.mark(i)
        ckpt = entry.checkpoint
        if ckpt is None:
            return
        placed = self._placed[ckpt.ckpt_id] + delta
        if placed:
            self._placed[ckpt.ckpt_id] = placed
            if placed == delta:  # the first request to carry it
                self._placed_on[ckpt.ckpt_id] = ckpt.holder
                if ckpt.ckpt_id not in self.held:
                    self._count_unreported(ckpt.holder)
        else:
            del self._placed[ckpt.ckpt_id]
            holder = self._placed_on.pop(ckpt.ckpt_id)
            if ckpt.ckpt_id not in self.held:
                self._uncount(holder)
        if worker:
            spread = self._spread.get(worker)
            if spread is None:
                spread = self._spread[worker] = Counter()
            n = spread[ckpt.holder] + delta
            if n:
                spread[ckpt.holder] = n
            else:
                del spread[ckpt.holder]
                if not spread:
                    del self._spread[worker]
            if cols is not None:
                column = cols.spread.get(worker)
                i = cols.index.get(ckpt.holder)
                if column is not None and i is not None:
                    column[i] += delta

    def _count_unreported(self, holder: str) -> None:
        self._unreported[holder] += 1
        cols = self._cols
        i = None if cols is None else cols.index.get(holder)
        if cols is not None and i is not None:
            cols.unreported[i] += 1

    def _uncount(self, holder: str) -> None:
        n = self._unreported[holder] - 1
        if n:
            self._unreported[holder] = n
        else:
            del self._unreported[holder]
        cols = self._cols
        i = None if cols is None else cols.index.get(holder)
        if cols is not None and i is not None:
            cols.unreported[i] -= 1

    # -- checkpoints --------------------------------------------------------------------

    def progress(self, report: CheckpointProgress) -> bool:
        """Record one holder report; returns whether a request here carries that checkpoint."""
        ckpt_id = report.ckpt_id
        old = self.held.pop(ckpt_id, None)
        if old is not None:
            self._add_bytes(old.holder, -old.bytes)
        if report.bytes != 0:
            self.held[ckpt_id] = Held(report.holder, report.bytes, report.tokens)
            self._add_bytes(report.holder, report.bytes)
        placed_on = self._placed_on.get(ckpt_id)
        if placed_on is not None and (old is None) != (report.bytes == 0):
            if old is None:  # its first report: no longer counted as unreported
                self._uncount(placed_on)
            else:  # reported gone (0 bytes) while a request still carries it
                self._count_unreported(placed_on)
        return ckpt_id in self._placed

    def _add_bytes(self, holder: str, delta: int) -> None:
        self._held_total += delta
        n = self._held_bytes[holder] + delta
        if n:
            self._held_bytes[holder] = n
        else:
            del self._held_bytes[holder]
        cols = self._cols
        if cols is not None:
            i = cols.index.get(holder)
            if i is not None:
                cols.held[i] = n
                cols.ckpt[i] = float(max(cols.hb_bytes[i], n))
                cols.mark(i)

    # -- per view -----------------------------------------------------------------------

    def columns(self, view: ClusterView) -> Columns:
        cols = self._cols
        if cols is not None and cols.view is view:
            return cols
        self.expire(view)
        workers = sorted(view.workers.values(), key=lambda w: w.name)
        hb_running = [w.load.running for w in workers]
        hb_queue = [w.load.running + w.load.waiting for w in workers]
        hb_bytes = [w.checkpoints.bytes_held for w in workers]
        queued = self._queued
        held = [self._held_bytes[w.name] for w in workers]
        cfg = policy_config(view.settings)
        queue = [max(q, queued[w.name]) for q, w in zip(hb_queue, workers, strict=True)]
        work = ([queued_prefill_s(q, r, cfg) for q, r in zip(queue, hb_running, strict=True)]
                if cfg.cost_aware else None)
        cols = Columns(
            view=view, workers=workers, index={w.name: i for i, w in enumerate(workers)},
            nodes=tuple(w.node for w in workers),
            budget=tuple(float(w.checkpoints.budget_bytes) for w in workers),
            eligible=tuple(self._eligible(view, w) for w in workers),
            hb_queue=hb_queue, hb_running=hb_running, hb_bytes=hb_bytes, held=held,
            unreported=[self._unreported.get(w.name, 0) for w in workers],
            queue=queue, ckpt=list(map(float, map(max, hb_bytes, held))), cfg=cfg, work=work)
        self._cols = cols
        return cols

    def table(self, cols: Columns, alive: Sequence[bool]) -> Table:
        return Table(cols.workers, LoadSnapshot(nodes=cols.nodes, ckpt_bytes=cols.ckpt,
                                                queue=cols.queue, budget_bytes=cols.budget,
                                                alive=alive, work_s=cols.work),
                     cols.cfg, cols.index)

    def holders_table(self, cols: Columns, serving: int) -> Table:
        """The holders' table for a checkpoint of `serving`: its queue one longer (the
        request being admitted) and each peer one byte heavier per checkpoint of `serving`
        it was given (a whole checkpoint heavier while placements await their reports), so
        holders that tie on L_hat take turns (a burst of admissions
        otherwise gives every checkpoint of the last worker in each round to the same
        peer, and its failure to that one holder)."""
        queue = cols.queue.copy()
        queue[serving] += 1
        column = self._spread_column(cols, serving)
        # max(heartbeat bytes, reported bytes + checkpoints placed), in C-level maps (ints:
        # alpha * n is the same float as alpha * float(n) for any byte count).
        held = cols.held
        if self._unreported:
            # Placed and not reported yet, at the mean reported size: within a burst the
            # reports lag the placements, and without this the holders that tie on the
            # queue would take every checkpoint of the burst until reports land.
            size = self._held_total // len(self.held) if self.held else UNREPORTED_BYTES
            held = held.copy()
            for name, n in self._unreported.items():
                i = cols.index.get(name)
                if i is not None:
                    held[i] += n * size
            # Counted so, the holders no longer tie: each checkpoint of `serving` a peer got
            # weighs a whole checkpoint there, so they still take turns (else the burst's
            # balance by totals gives every checkpoint of one worker to one peer).
            column = [n * size for n in column]
        ckpt = list(map(max, cols.hb_bytes, map(operator.add, held, column)))
        return Table(cols.workers, LoadSnapshot(nodes=cols.nodes, ckpt_bytes=ckpt, queue=queue,
                                                budget_bytes=cols.budget, alive=cols.eligible),
                     cols.cfg, cols.index)

    def _spread_column(self, cols: Columns, serving: int) -> list[int]:
        """Per worker, the checkpoints of `serving` placed there (live)."""
        name = cols.workers[serving].name
        column = cols.spread.get(name)
        if column is None:
            placed: Mapping[str, int] = self._spread.get(name) or {}
            column = cols.spread[name] = [placed.get(w.name, 0) for w in cols.workers]
        return column

    # -- an admission's two decisions, from the rankings ---------------------------------

    def least_loaded(self, cols: Columns, alive: Sequence[bool]) -> int | None:
        """`policy.least_loaded` over `table(cols, alive)` (`alive` within the eligible)."""
        rank = cols.admit_rank
        if rank is None:
            rank = self._rank(cols, by_queue=cols.cfg.admission == "queue")
        return first_alive(rank.order(), alive)

    def holder(self, cols: Columns, serving: int) -> tuple[int, float] | None:
        """Algorithm 1 for a checkpoint of `serving` (`place_checkpoint` of one byte over
        `holders_table(cols, serving)`): the holder and its L_hat in that table, or None."""
        cfg = cols.cfg
        if cfg.mode is Mode.lumen and cfg.load_aware_placement:
            found = self._ranked_holder(cols, serving)
            if found is not None:
                return found
        # Another policy, or the fast path's answer is not the common case (no worker on
        # another node, or its budget full): the policy over the whole table.
        holders = self.holders_table(cols, serving)
        h = place_checkpoint(holders.snapshot, serving, 1.0, cfg)
        return None if h is None else (h, holders.load(h))

    def _ranked_holder(self, cols: Columns, serving: int) -> tuple[int, float] | None:
        """`policy.choose_holder_in`'s fast path over the holders' table: min (L_hat, index)
        over eligible workers on another node than `serving`'s, if its budget fits one
        byte; None otherwise (then the caller asks the policy).

        Walks the workers ranked by L_hat without the holders' table's additions (the
        checkpoints placed and not reported, and `serving`'s own on each, both >= 0 bytes):
        each key is a lower bound of that worker's value in the table, so the walk stops at
        the first key above the best value found. The values are computed as
        `holders_table` and `policy.loads` compute them (same integers, same float
        operations), so the choice is the same, ties included."""
        rank = cols.holder_rank
        if rank is None:
            rank = self._rank(cols, by_queue=False)
        order = rank.order()
        column = self._spread_column(cols, serving)
        # Placed and not reported: counted at the mean reported size, and then `serving`'s
        # checkpoints too (holders_table); else each of `serving`'s weighs one byte.
        unit = ((self._held_total // len(self.held) if self.held else UNREPORTED_BYTES)
                if self._unreported else 1)
        alpha, beta = cols.cfg.alpha, cols.cfg.beta
        nodes, hb, held, unreported, queue = (cols.nodes, cols.hb_bytes, cols.held,
                                              cols.unreported, cols.queue)
        home = nodes[serving]
        # The best (value, index) so far, compared as that pair; above every pair at first.
        best, best_i, best_bytes = math.inf, len(nodes), 0
        for key, i in order:
            if key > best or (key == best and i > best_i):
                break
            if nodes[i] == home:
                continue
            ckpt = held[i] + (unreported[i] + column[i]) * unit
            beat = hb[i]
            if beat > ckpt:  # max(heartbeat bytes, ...), as holders_table
                ckpt = beat
            value = alpha * ckpt + beta * queue[i]
            if value < best or (value == best and i < best_i):
                best, best_i, best_bytes = value, i, ckpt
        if best == math.inf or best_bytes + 1.0 > cols.budget[best_i]:
            return None
        return best_i, best

    def _rank(self, cols: Columns, by_queue: bool) -> Ranking:
        """Build the ranking the admission (`by_queue` or by L_hat) or Algorithm 1 reads."""
        queue, ckpt, cfg = cols.queue, cols.ckpt, cols.cfg
        members = [i for i, ok in enumerate(cols.eligible) if ok]
        if by_queue:
            by_count = cols.admit_rank = Ranking(lambda i: float(queue[i]), members)
            return by_count
        rank = cols.holder_rank
        if rank is None:
            # alpha * float(bytes) is alpha * bytes: L_hat as `policy.loads` computes it
            rank = cols.holder_rank = Ranking(lambda i: l_hat(ckpt[i], queue[i], cfg),
                                              members)
        if cfg.admission != "queue":
            cols.admit_rank = rank
        return rank

    def loads(self, view: ClusterView) -> dict[str, float]:
        cols = self.columns(view)
        t = self.table(cols, cols.eligible)
        return {w.name: t.load(i) if cols.eligible[i] else math.inf
                for i, w in enumerate(cols.workers)}

    # -- expiry -------------------------------------------------------------------------

    def expire(self, view: ClusterView | None = None, now: float | None = None) -> int:
        """Forget entries whose gateway's node left `view` or restarted, and those older
        than the TTL. Returns how many were forgotten."""
        now = self._clock() if now is None else now
        gone = 0
        if view is not None:
            for key in [k for k in self._by_gateway if _gateway_gone(view, *k)]:
                for request_id in list(self._by_gateway.get(key, ())):
                    if self.finish(request_id) is not None:
                        gone += 1
                        self.expired["gateway_gone"] += 1
        oldest = self._bucket(now - self._ttl_s)
        for bucket in [b for b in self._buckets if b < oldest]:
            for request_id in list(self._buckets.get(bucket, ())):
                if self.finish(request_id) is not None:
                    gone += 1
                    self.expired["ttl"] += 1
        return gone

    @staticmethod
    def _bucket(at: float) -> int:
        return int(at // BUCKET_S)


def _gateway_gone(view: ClusterView, gateway: str, started_at: float) -> bool:
    node = view.nodes.get(gateway)
    return node is None or node.started_at != started_at
