"""The holder's memory: KV pages of checkpoints, charged to the workers of this node.

Pure bookkeeping, no I/O: the service (holder.py) decodes messages and calls in here, tests
drive it directly with a fake clock. A page is kept as the buffer it arrived in (a ZeroMQ
frame), so storing it copies nothing.

Invariant: for every worker, the bytes held never exceed its budget. A page that does not
fit either makes room by evicting whole checkpoints of the same worker (policy `lru`,
`shortest_prefix`, `longest_prefix_protected`) or is refused (`refuse`, or when eviction
cannot free enough). A checkpoint refused or evicted stays dead until its TTL passes:
later pages of it are refused, since pages beyond a lost prefix are useless.
A finished one stays dead for the TTL too: an engine's pages and its scheduler's FINISH
travel on two connections, and a page that arrives after the FINISH would otherwise grow the
checkpoint back as an orphan holding budget until the TTL.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lumend.checkpoint.wire import Reason

Policy = Literal["lru", "shortest_prefix", "longest_prefix_protected", "refuse"]
# longest_prefix_protected never evicts this share of a worker's checkpoints: the longest
# ones (at least one), whose recompute would cost the most.
PROTECTED_SHARE = 0.25
DEAD_REMEMBERED = 65536


@dataclass(frozen=True)
class PageMeta:
    block_index: int
    token_count: int
    dtype: str
    page_shape: tuple[int, ...]


@dataclass
class Page:
    meta: PageMeta
    data: Any  # a buffer (zmq.Frame, bytes, memoryview); never copied
    nbytes: int


@dataclass
class Checkpoint:
    ckpt_id: str
    request_id: str
    worker: str
    model: str
    fingerprint: str
    tp_size: int
    last_activity: float
    pages: dict[tuple[bytes, int], Page] = field(default_factory=dict)
    indices: dict[int, set[int]] = field(default_factory=dict)  # tp rank -> block indices
    reached: dict[int, int] = field(default_factory=dict)       # tp rank -> contiguous count
    nbytes: int = 0
    tokens: int = 0
    sealed: bool = False  # a page was refused: what it holds stays, nothing more is added
    # The engine request that first wrote it (PUT), or the newest that looked it up (LOOKUP)
    # to resume: only its FINISH frees the checkpoint. After a request moved to another
    # engine, the engine it left (which may still be writing, during a make-before-break
    # migration) must not free what the new one continues from.
    owner: str = ""

    def add(self, block_hash: bytes, tp_rank: int, page: Page) -> None:
        old = self.pages.get((block_hash, tp_rank))
        if old is not None:
            self.nbytes -= old.nbytes
        self.pages[(block_hash, tp_rank)] = page
        self.nbytes += page.nbytes
        self.tokens = max(self.tokens, page.meta.token_count)
        held = self.indices.setdefault(tp_rank, set())
        held.add(page.meta.block_index)
        n = self.reached.get(tp_rank, 0)
        while n in held:
            n += 1
        self.reached[tp_rank] = n


@dataclass
class WorkerStats:
    budget_bytes: int
    bytes_held: int = 0
    requests: int = 0
    evictions: int = 0
    refusals: int = 0
    orphans: int = 0


class StoreRefusal(Exception):
    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason: Reason = reason


@dataclass(frozen=True)
class PutResult:
    reached: int
    evicted: tuple[str, ...] = ()


class CheckpointStore:
    def __init__(self, workers: Sequence[str], budget_bytes: int, policy: Policy,
                 ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.ttl_s = ttl_s
        self._clock = clock
        self.stats: dict[str, WorkerStats] = {w: WorkerStats(budget_bytes) for w in workers}
        self.checkpoints: dict[str, Checkpoint] = {}
        # ckpt id -> when and why it died (refused, evicted or finished); a bounded memory,
        # oldest forgotten
        self._dead: OrderedDict[str, tuple[float, Reason]] = OrderedDict()

    # -- writes ---------------------------------------------------------------------------

    def put(self, *, ckpt_id: str, request_id: str, worker: str, model: str,
            fingerprint: str, tp_rank: int, tp_size: int, block_hash: bytes, meta: PageMeta,
            data: Any, nbytes: int) -> PutResult:
        """Store one page or raise StoreRefusal (the refusal is already counted)."""
        stats = self.stats.get(worker)
        if stats is None:
            raise StoreRefusal("unknown_worker", f"worker: {worker!r} is not a worker of this "
                               f"node ({', '.join(self.stats) or 'it has none'})")
        now = self._clock()
        dead = self._dead.get(ckpt_id)
        if dead is not None:
            if dead[1] == "finished":
                raise StoreRefusal("finished", f"checkpoint {ckpt_id}: its request finished "
                                   "before this page arrived; the page is not kept")
            raise StoreRefusal("evicted", f"checkpoint {ckpt_id} was evicted or refused; "
                               "its later pages are not kept")
        ckpt = self.checkpoints.get(ckpt_id)
        if ckpt is not None:
            self._check_layout(ckpt, worker, model, fingerprint, tp_size)
            ckpt.last_activity = now
            if ckpt.sealed:
                raise StoreRefusal("budget", f"checkpoint {ckpt_id} stopped growing when a "
                                   "page of it was refused; it keeps what it holds")
        old = ckpt.pages.get((block_hash, tp_rank)) if ckpt is not None else None
        growth = nbytes - (old.nbytes if old is not None else 0)
        evicted: list[str] = []
        if stats.bytes_held + growth > stats.budget_bytes:
            evicted = self._make_room(worker, growth, keep=ckpt_id)
            if stats.bytes_held + growth > stats.budget_bytes:
                stats.refusals += 1
                if ckpt is None:
                    self._mark_dead(ckpt_id, now)
                    raise StoreRefusal("budget", f"worker {worker}: budget of "
                                       f"{stats.budget_bytes} bytes is full; checkpoint "
                                       f"{ckpt_id} refused")
                ckpt.sealed = True
                raise StoreRefusal("budget", f"worker {worker}: budget of "
                                   f"{stats.budget_bytes} bytes is full; page "
                                   f"{meta.block_index} of {ckpt_id} refused (the checkpoint "
                                   "keeps what it holds)")
        if ckpt is None:
            ckpt = Checkpoint(ckpt_id, request_id, worker, model, fingerprint, tp_size, now)
            self.checkpoints[ckpt_id] = ckpt
            stats.requests += 1
        ckpt.add(block_hash, tp_rank, Page(meta, data, nbytes))
        ckpt.owner = ckpt.owner or request_id
        stats.bytes_held += growth
        return PutResult(ckpt.reached.get(tp_rank, 0), tuple(evicted))

    def finish(self, ckpt_id: str, request_id: str = "") -> int | None:
        """Free a checkpoint's pages (every rank); returns the bytes freed. Idempotent.

        None when `request_id` names a request that no longer owns the checkpoint (another
        engine resumed it since): nothing is freed."""
        ckpt = self.checkpoints.get(ckpt_id)
        if ckpt is not None and request_id and ckpt.owner and request_id != ckpt.owner:
            return None
        if ckpt is None:
            return 0  # never held, or evicted or refused: a dead one stays so for the TTL
        self._drop(ckpt)
        self._mark_dead(ckpt_id, self._clock(), "finished")
        return ckpt.nbytes

    def collect_orphans(self) -> list[str]:
        """Drop checkpoints with no activity for the TTL; forget dead ids as old."""
        now = self._clock()
        horizon = now - self.ttl_s
        orphans = [c for c in self.checkpoints.values() if c.last_activity < horizon]
        for ckpt in orphans:
            self._drop(ckpt)
            self.stats[ckpt.worker].orphans += 1
        while self._dead and next(iter(self._dead.values()))[0] < horizon:
            self._dead.popitem(last=False)
        return [c.ckpt_id for c in orphans]

    # -- reads ----------------------------------------------------------------------------

    def lookup(self, ckpt_id: str, hashes: Sequence[bytes], *, model: str = "",
               fingerprint: str = "", request_id: str = "") -> int:
        """How many consecutive blocks of `hashes`, from the first, every tp rank holds.
        A `request_id` (a resuming engine's request) takes over ownership when any match."""
        ckpt = self.checkpoints.get(ckpt_id)
        if ckpt is None:
            return 0
        if (model and model != ckpt.model) or (fingerprint and fingerprint != ckpt.fingerprint):
            raise StoreRefusal("fingerprint", f"checkpoint {ckpt_id} holds {ckpt.model} pages "
                               f"of layout {ckpt.fingerprint}, not {model} / {fingerprint}")
        ckpt.last_activity = self._clock()
        matched = 0
        for h in hashes:
            if not all((h, rank) in ckpt.pages for rank in range(ckpt.tp_size)):
                break
            matched += 1
        if matched and request_id:
            ckpt.owner = request_id
        return matched

    def get(self, ckpt_id: str, block_hash: bytes, tp_rank: int) -> Page | None:
        ckpt = self.checkpoints.get(ckpt_id)
        if ckpt is None:
            return None
        ckpt.last_activity = self._clock()
        return ckpt.pages.get((block_hash, tp_rank))

    def bytes_held(self, worker: str) -> int:
        return self.stats[worker].bytes_held

    # -- internals ------------------------------------------------------------------------

    def _check_layout(self, ckpt: Checkpoint, worker: str, model: str, fingerprint: str,
                      tp_size: int) -> None:
        for name, have, got in (("worker", ckpt.worker, worker), ("model", ckpt.model, model),
                                ("layout_fingerprint", ckpt.fingerprint, fingerprint),
                                ("tp_size", ckpt.tp_size, tp_size)):
            if have != got:
                raise StoreRefusal("fingerprint", f"{name}: {got!r} differs from {have!r} of "
                                   f"checkpoint {ckpt.ckpt_id}'s first page")

    def _drop(self, ckpt: Checkpoint) -> None:
        del self.checkpoints[ckpt.ckpt_id]
        stats = self.stats[ckpt.worker]
        stats.bytes_held -= ckpt.nbytes
        stats.requests -= 1

    def _mark_dead(self, ckpt_id: str, now: float, why: Reason = "evicted") -> None:
        self._dead[ckpt_id] = (now, why)
        self._dead.move_to_end(ckpt_id)
        while len(self._dead) > DEAD_REMEMBERED:
            self._dead.popitem(last=False)

    def _make_room(self, worker: str, needed: int, keep: str) -> list[str]:
        """Evict whole checkpoints of `worker` by the policy until `needed` bytes fit.

        Evicts nothing when even every candidate together would not make enough room, so a
        page that will be refused anyway costs no one their checkpoint.
        """
        if self.policy == "refuse":
            return []
        stats = self.stats[worker]
        candidates = self._victims(worker, keep)
        shortfall = stats.bytes_held + needed - stats.budget_bytes
        if sum(c.nbytes for c in candidates) < shortfall:
            return []
        evicted = []
        for ckpt in candidates:
            if stats.bytes_held + needed <= stats.budget_bytes:
                break
            self._drop(ckpt)
            self._mark_dead(ckpt.ckpt_id, self._clock())
            stats.evictions += 1
            evicted.append(ckpt.ckpt_id)
        return evicted

    def _victims(self, worker: str, keep: str) -> list[Checkpoint]:
        """The worker's checkpoints in eviction order (first evicted first)."""
        mine = [c for c in self.checkpoints.values() if c.worker == worker and c.ckpt_id != keep]
        if self.policy == "lru":
            return sorted(mine, key=lambda c: c.last_activity)
        by_length = sorted(mine, key=lambda c: (c.tokens, c.last_activity))
        if self.policy == "longest_prefix_protected" and by_length:
            protected = max(1, math.ceil(len(by_length) * PROTECTED_SHARE))
            return by_length[:-protected]
        return by_length
