"""Admissions from the rankings decide exactly as the former full tables did (issue 16).

The coordinator now answers an admission's two argmins (the least loaded serving worker,
then Algorithm 1's holder) by walking workers kept ranked per change
(lumend.coordinator.ranking) instead of rebuilding the load table and the holders' table
for each admission. `former_admit` below is the former `CoordinatorService.admit`, kept as
the reference: on random books (workers on random nodes, models, budgets down to none,
heartbeats, policies and weights, requests admitted, finished and reported in any order),
every admission of a batch (admissions in a row, as the Admit handler decides a batch)
gets the same worker, the same holder and the same reason from both, the reference
deciding over its own copy of the same book.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from lumend.cluster.models import ClusterSettings, WorkerLoad
from lumend.cluster.view import ClusterView
from lumend.coordinator.policy import least_loaded, place_checkpoint
from lumend.coordinator.ranking import Ranking
from lumend.coordinator.service import CoordinatorService
from lumend.rpc.messages import CheckpointProgress, CheckpointRef
from tests.unit.test_coordinator_loadbook import cluster, worker

GIB = 1 << 30
BYTES = (0, 4096, 16 << 20, GIB // 4, GIB)
BUDGETS = (0, 1 << 20, GIB, 1 << 50)

worker_st = st.tuples(st.integers(0, 4),                      # node
                      st.sampled_from(["m", "m", "other"]),     # model
                      st.sampled_from(BUDGETS),
                      st.booleans())                            # serving (else failed)
heartbeat_st = st.tuples(st.integers(0, 3), st.integers(0, 3), st.sampled_from(BYTES))
settings_st = st.builds(
    ClusterSettings, alpha=st.sampled_from([0.0, 1.0 / GIB, 64.0 / GIB]),
    beta=st.sampled_from([0.0, 0.5, 1.0]), decisions=st.sampled_from(["cost_aware", "paper"]),
    mode=st.sampled_from(["lumen", "lumen", "fixed_checkpoint", "stop_and_restart"]))

batch_op = st.tuples(st.just("batch"), st.lists(st.tuples(
    st.sampled_from([None, "m", "other"]), st.lists(st.integers(0, 23), max_size=2)),
    min_size=1, max_size=24))
finish_op = st.tuples(st.just("finish"), st.integers(0, 999))
progress_op = st.tuples(st.just("progress"), st.integers(0, 999), st.sampled_from(BYTES))
view_op = st.tuples(st.just("heartbeat"), st.lists(heartbeat_st, min_size=24, max_size=24),
                    settings_st)
OPS = st.lists(st.one_of(batch_op, batch_op, finish_op, finish_op, progress_op, progress_op,
                         view_op), max_size=40)


def former_admit(service: CoordinatorService, request_id: str, model: str | None,
                 gateway: str, exclude: list[str]) -> tuple[str | None, str | None, str]:
    """The former admission: the whole load table and holders' table per admission."""
    view = service._read()
    book = service.book
    cols = book.columns(view)
    alive: list[bool] = list(cols.serving(model))
    for i in (cols.index[name] for name in exclude if name in cols.index):
        alive[i] = False
    table = book.table(cols, alive)
    index = least_loaded(table.snapshot, table.cfg)
    if index is None:
        return None, None, "no worker"
    name = cols.workers[index].name
    if table.cfg.admission == "queue":
        reason = f"admitted to {name} (queue {cols.queue[index]}, the shortest)"
    else:
        reason = f"admitted to {name} (L_hat {table.load(index):.3g}, the lowest)"
    holders = book.holders_table(cols, index)
    h = place_checkpoint(holders.snapshot, index, 1.0, holders.cfg)
    ckpt = None
    if h is not None:
        holder = cols.workers[h]
        ckpt = CheckpointRef(f"{service._ckpt_prefix}{next(service._ckpt_seq):016x}",
                             holder.name, "tcp://" + view.nodes[holder.node].checkpoint)
        reason += f"; checkpoint on {holder.name} (L_hat {holders.load(h):.3g})"
    book.admit(request_id, name, ckpt, gateway, view)
    return name, None if ckpt is None else ckpt.holder, reason


class Books:
    """The same requests, reports and views given to a service and to the reference."""

    def __init__(self, workers: list[tuple[int, str, int, bool]], config: ClusterSettings):
        self.records = [worker(f"n{n}-w{k}", f"n{n}", budget=budget, model=model,
                               state="serving" if serving else "failed")
                        for k, (n, model, budget, serving) in enumerate(workers)]
        self.view = self._view(self.records, config)
        self.service = CoordinatorService("n0", 1, lambda: self.view)
        self.former = CoordinatorService("n0", 1, lambda: self.view)
        self.ids: list[str] = []
        self.compared = 0

    @staticmethod
    def _view(records: list[Any], config: ClusterSettings) -> ClusterView:
        return cluster(records, gateways=("gw",), settings=config)

    def pick(self, k: int) -> str:
        return self.ids[k % len(self.ids)] if self.ids else "never-admitted"

    def step(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        names = [w.name for w in self.records]
        if kind == "batch":
            for model, excluded in op[1]:
                rid = f"r{len(self.ids)}"
                self.ids.append(rid)
                exclude = [names[i % len(names)] for i in excluded]
                want = former_admit(self.former, rid, model, "gw", exclude)
                got = self.service.admit(rid, model, "gw", exclude)
                target = got.target.worker if got.target else None
                holder = got.checkpoint.holder if got.checkpoint else None
                assert (target, holder) == want[:2], (rid, got.reason, want[2])
                if target is not None:
                    assert got.reason.startswith(want[2]), (got.reason, want[2])
                self.compared += 1
        elif kind == "finish":
            rid = self.pick(op[1])
            assert self.service.finish(rid) == self.former.finish(rid)
        elif kind == "progress":
            rid = self.pick(op[1])
            for s in (self.service, self.former):
                entry = s.requests.get(rid)
                if entry is not None and entry.checkpoint is not None:
                    s.progress(CheckpointProgress(entry.checkpoint.ckpt_id,
                                                  entry.checkpoint.holder, op[2], 64))
        elif kind == "heartbeat":
            beats, config = op[1], op[2]
            self.records = [replace(w, load=WorkerLoad(running=r, waiting=q),
                                    checkpoints=replace(w.checkpoints, bytes_held=b))
                            for w, (r, q, b) in zip(self.records, beats, strict=False)]
            self.view = self._view(self.records, config)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(worker_st, min_size=1, max_size=24), settings_st, OPS)
def test_a_batch_decides_as_the_former_tables_on_random_books(
        workers: list[tuple[int, str, int, bool]], config: ClusterSettings,
        ops: list[tuple[Any, ...]]) -> None:
    books = Books(workers, config)
    for op in ops:
        books.step(op)


def burst(books: Books, rounds: int) -> None:
    for _ in range(rounds):
        books.step(("batch", [(None, [])] * 16))
        books.step(("progress", len(books.ids) - 3, 16 << 20))
        books.step(("finish", len(books.ids) - 7))


def sixteen_workers() -> list[tuple[int, str, int, bool]]:
    return [(n, "m", 1 << 50, True) for n in range(4) for _ in range(4)]


def test_a_long_burst_decides_as_the_former_tables() -> None:
    """Hundreds of admissions over 16 workers on 4 nodes, with reports and finishes among
    them: the rankings are re-keyed thousands of times and still agree."""
    for decisions in ("cost_aware", "paper"):
        books = Books(sixteen_workers(), ClusterSettings(decisions=decisions))
        burst(books, 60)
        assert books.compared == 960


def test_the_comparison_sees_a_ranking_that_is_not_kept(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Negative control: rankings that miss their changes (marks dropped) decide otherwise,
    and the comparison says so."""
    books = Books(sixteen_workers(), ClusterSettings())
    monkeypatch.setattr(Ranking, "mark", lambda self, index: None)
    with pytest.raises(AssertionError):
        burst(books, 60)
