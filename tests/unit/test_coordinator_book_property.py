"""The load book's incremental tables equal a full recomputation (issue 16), whatever the
order of admissions, finishes, recoveries, holder reports, heartbeats (new views) and time.

After every step the columns a decision reads (per-worker queue, checkpoint bytes per
holder, queued prefill seconds, the holders' table of a serving worker, the eligible workers
ranked by the admission's key and by L_hat) and the book's own counters are compared with
the same quantities recomputed from scratch: from the requests the book holds, the reports
it holds and the view (a checkpoint placed and not reported yet weighs the mean reported
size in the holders' table). Entries of a gateway whose node left or restarted, and entries
older than the TTL, are gone once a view (or `expire`) has seen it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from lumend.cluster.keys import Keys
from lumend.cluster.models import ClusterSettings, WorkerLoad
from lumend.cluster.view import ClusterView
from lumend.coordinator.loadbook import BUCKET_S, UNREPORTED_BYTES, LoadBook
from lumend.coordinator.service import CoordinatorService, eligible
from lumend.coordinator.settings import policy_config
from lumend.rpc.messages import CheckpointProgress, RecoverAsk
from tests.unit.test_coordinator_loadbook import cluster, node, worker

TTL_S = 600.0
NAMES = [f"n{n}-w{k}" for n in range(4) for k in range(2)]
GATEWAYS = ("g1", "g2", "not-a-node")
BYTES = (0, 4096, 1 << 20, 1 << 28)

admit_op = st.tuples(st.just("admit"), st.sampled_from([None, "m", "other"]),
                     st.sampled_from(GATEWAYS), st.lists(st.sampled_from(NAMES), max_size=3))
finish_op = st.tuples(st.just("finish"), st.integers(0, 63))
progress_op = st.tuples(st.just("progress"), st.integers(0, 63), st.sampled_from(BYTES),
                        st.sampled_from([None, *NAMES]))
recover_op = st.tuples(st.just("recover"), st.integers(0, 63))
heartbeat_op = st.tuples(
    st.just("heartbeat"),
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.sampled_from(BYTES)),
             min_size=len(NAMES), max_size=len(NAMES)),
    st.sets(st.sampled_from(NAMES), max_size=2),  # workers not serving in this view
    st.sampled_from(["same", "g1 gone", "g1 restarted", "g2 restarted"]),
    st.sampled_from(["cost_aware", "paper"]))
time_op = st.tuples(st.just("time"), st.floats(0, 2 * TTL_S))
OPS = st.lists(st.one_of(admit_op, admit_op, finish_op, progress_op, recover_op, heartbeat_op,
                         time_op), max_size=80)


class World:
    """A coordinator service over views this test makes, on a clock it moves."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.started = {"g1": 5.0, "g2": 5.0}
        self.workers = [worker(name, name.split("-")[0], model="m" if name < "n3" else "other",
                               budget=1 << 40) for name in NAMES]
        self.view = self._view(ClusterSettings())
        self.service = CoordinatorService("n0", 1, lambda: self.view)
        self.service.book = LoadBook(eligible, ttl_s=TTL_S, clock=lambda: self.now)
        self.ids: list[str] = []  # every id admitted so far (finished ones too)

    def _view(self, settings: ClusterSettings) -> ClusterView:
        v = cluster(self.workers, settings=settings)
        nodes = dict(v.nodes)
        for gw, started in self.started.items():
            if started >= 0:
                nodes[gw] = node(gw, started)
        return ClusterView(cluster=v.cluster, revision=v.revision + 1, nodes=nodes,
                           workers=v.workers, settings=settings)

    def pick(self, k: int) -> str:
        return self.ids[k % len(self.ids)] if self.ids else "never-admitted"

    def step(self, op: tuple[Any, ...]) -> None:
        s = self.service
        kind = op[0]
        if kind == "admit":
            rid = f"r{len(self.ids)}"
            self.ids.append(rid)
            s.admit(rid, op[1], op[2], op[3])
        elif kind == "finish":
            s.finish(self.pick(op[1]))
        elif kind == "progress":
            entry = s.requests.get(self.pick(op[1]))
            if entry is None or entry.checkpoint is None:
                s.progress(CheckpointProgress("stray", op[3] or NAMES[0], op[2], 64))
            else:  # its holder, or (a stale report) another worker naming the same id
                s.progress(CheckpointProgress(entry.checkpoint.ckpt_id,
                                              op[3] or entry.checkpoint.holder, op[2], 64))
        elif kind == "recover":
            rid = self.pick(op[1])
            entry = s.requests.get(rid)
            if entry is not None:
                s.recover(RecoverAsk(rid, entry.worker or NAMES[0], 160, "", entry.checkpoint,
                                     entry.gateway))
        elif kind == "heartbeat":
            loads, down, gateways, decisions = op[1:]
            self.workers = [replace(w, load=WorkerLoad(running=r, waiting=q),
                                    checkpoints=replace(w.checkpoints, bytes_held=b),
                                    state="failed" if w.name in down else "serving")
                            for w, (r, q, b) in zip(self.workers, loads, strict=True)]
            if gateways == "g1 gone":
                self.started["g1"] = -1.0
            elif gateways != "same":
                gw = gateways.split()[0]
                self.started[gw] = abs(self.started[gw]) + 1.0
            self.view = self._view(ClusterSettings(decisions=decisions))
            s.lead_ops(self.view, Keys("t"))  # a new HA cycle reads the view
        elif kind == "time":
            self.now += op[1]
            s.expire(self.view)


def recomputed(world: World) -> dict[str, Any]:
    """Every quantity the book keeps incrementally, from scratch."""
    book, view = world.service.book, world.view
    requests, held = book.requests, book.held
    workers = sorted(view.workers.values(), key=lambda w: w.name)
    queued = Counter(r.worker for r in requests.values() if r.worker)
    by_holder: Counter[str] = Counter()
    for h in held.values():
        by_holder[h.holder] += h.bytes
    cfg = policy_config(view.settings)
    queue = [max(w.load.running + w.load.waiting, queued[w.name]) for w in workers]
    spread: dict[str, Counter[str]] = {}
    for r in requests.values():
        if r.worker and r.checkpoint is not None:
            spread.setdefault(r.worker, Counter())[r.checkpoint.holder] += 1
    unreported = {r.checkpoint.ckpt_id: r.checkpoint.holder for r in requests.values()
                  if r.checkpoint is not None and r.checkpoint.ckpt_id not in held}
    size = sum(h.bytes for h in held.values()) // len(held) if held else UNREPORTED_BYTES
    pending = Counter(unreported.values())
    ckpt = [float(max(w.checkpoints.bytes_held, by_holder[w.name])) for w in workers]
    live = [i for i, w in enumerate(workers) if eligible(view, w)]
    by_lhat = sorted((cfg.alpha * ckpt[i] + cfg.beta * queue[i], i) for i in live)
    return {
        "queue": queue,
        "held": [by_holder[w.name] for w in workers],
        "ckpt": ckpt,
        "admit_rank": (sorted((float(queue[i]), i) for i in live)
                       if cfg.admission == "queue" else by_lhat),
        "holder_rank": by_lhat,
        "work": ([cfg.beta * max(0, q - w.load.running) for q, w in
                  zip(queue, workers, strict=True)] if cfg.cost_aware else None),
        "eligible": [eligible(view, w) for w in workers],
        "queued": +queued, "held_bytes": +by_holder, "spread": spread,
        "placed": +Counter(r.checkpoint.ckpt_id for r in requests.values() if r.checkpoint),
        "unreported": +pending,
        "unreported_column": [pending[w.name] for w in workers],
        "holders": {w.name: [max(x.checkpoints.bytes_held,
                                 by_holder[x.name] + (spread.get(w.name, Counter())[x.name]
                                                      + pending[x.name]) * (size if pending else 1))
                             for x in workers] for w in workers},
    }


def kept(world: World) -> dict[str, Any]:
    """The same quantities as the book keeps them (its live columns and counters)."""
    book = world.service.book
    cols = book.columns(world.view)  # the view already seen: no rescan, no expiry here
    return {
        "queue": list(cols.queue), "held": list(cols.held), "ckpt": list(cols.ckpt),
        "work": None if cols.work is None else list(cols.work),
        "eligible": list(cols.eligible),
        "admit_rank": list((cols.admit_rank or book._rank(
            cols, by_queue=cols.cfg.admission == "queue")).order()),
        "holder_rank": list((cols.holder_rank or book._rank(cols, by_queue=False)).order()),
        "queued": +book._queued, "held_bytes": +book._held_bytes,
        "spread": {k: +v for k, v in book._spread.items()}, "placed": +book._placed,
        "unreported": +book._unreported,
        "unreported_column": list(cols.unreported),
        "holders": {w.name: list(book.holders_table(cols, i).snapshot.ckpt_bytes)
                    for i, w in enumerate(cols.workers)},
    }


def check_expiry(world: World) -> None:
    book = world.service.book
    for rid, r in book.requests.items():
        if r.gateway_started is not None:  # a gateway that is a node: alive, same start
            gw = world.view.nodes.get(r.gateway)
            assert gw is not None and gw.started_at == r.gateway_started, (rid, r)
        # Expiry goes by buckets of admission time: at most one bucket past the TTL.
        assert r.at > book._clock() - TTL_S - BUCKET_S, (rid, r)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_incremental_tables_equal_a_full_recomputation(ops: list[tuple[Any, ...]]) -> None:
    world = World()
    for op in ops:
        world.step(op)
        want, got = recomputed(world), kept(world)
        for key in want:
            assert got[key] == want[key], (key, op)
        check_expiry(world)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_a_gone_gateways_entries_expire_and_their_counts_with_them(
        ops: list[tuple[Any, ...]]) -> None:
    world = World()
    for op in ops:
        world.step(op)
    before = {rid for rid, r in world.service.requests.items() if r.gateway == "g2"}
    world.step(("heartbeat", [(0, 0, 0)] * len(NAMES), set(), "g2 restarted", "cost_aware"))
    assert not {rid for rid, r in world.service.requests.items() if r.gateway == "g2"}
    assert world.service.book.expired["gateway_gone"] >= len(before)
    assert kept(world) == recomputed(world)
    # The TTL forgets everything else (the gateway that is not a node included).
    world.step(("time", TTL_S + BUCKET_S))
    assert not world.service.requests
    assert kept(world) == recomputed(world)


def test_the_comparison_sees_a_count_kept_wrong() -> None:
    """Negative control: a request moved behind the book's back shows as a difference."""
    world = World()
    for _ in range(20):
        world.step(("admit", None, "g1", []))
    entry = next(iter(world.service.requests.values()))
    entry.worker = "n3-w1" if entry.worker != "n3-w1" else "n0-w0"
    assert kept(world)["queued"] != recomputed(world)["queued"]
