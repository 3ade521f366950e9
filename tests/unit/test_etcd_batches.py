"""Pure pieces of etcd hygiene: transactions packed under etcd's limit, and what of a
heartbeat record counts as a change worth a write."""

from __future__ import annotations

import msgspec

from lumend.cluster.agent import _batches, _coarse, _meaningful
from lumend.cluster.models import CheckpointUsage, WorkerLoad, WorkerRecord
from lumend.cluster.store import MAX_TXN_OPS, Delete, Op, Put


def puts(n: int, tag: str) -> list[Op]:
    return [Put(f"/{tag}/{i}", b"") for i in range(n)]


def test_batches_stay_under_the_limit_and_keep_groups_whole() -> None:
    groups: list[list[Op]] = [puts(60, "a"), puts(60, "b"), [Delete("/c")], puts(250, "big"),
                              puts(3, "d")]
    batches = _batches(groups, MAX_TXN_OPS)
    assert all(0 < len(b) <= MAX_TXN_OPS for b in batches)
    assert [op for b in batches for op in b] == [op for g in groups for op in g]  # order kept
    # A group that fits is never split across two transactions.
    for group in (groups[0], groups[1], groups[4]):
        assert any(all(op in b for op in group) for b in batches)
    assert _batches([], MAX_TXN_OPS) == []
    # 200 single-op groups (200 joins): two transactions, not one of 200.
    assert [len(b) for b in _batches([[op] for op in puts(200, "j")], MAX_TXN_OPS)] == [100, 100]


def test_coarse_counts_are_exact_when_small_and_within_an_eighth_above() -> None:
    assert [_coarse(n) for n in range(17)] == list(range(17))
    for n in range(17, 5000):
        assert n * 7 / 8 <= _coarse(n) <= n, n
    assert _coarse(0) != _coarse(1)


def record(**load: object) -> WorkerRecord:
    return WorkerRecord(name="w", node="n", gpus=[0], engine="sim", model="m", state="serving",
                        load=WorkerLoad(**load),  # type: ignore[arg-type]
                        checkpoints=CheckpointUsage(bytes_held=500 << 20, budget_bytes=1 << 30),
                        updated_at=1.0)


def test_jitter_is_not_a_change_and_what_decisions_turn_on_is() -> None:
    base = _meaningful(record(running=20, kv_usage=0.40))
    # Jitter: a request either way above 16, kv usage within its 5% step, a timestamp,
    # checkpoint bytes within 1/32 of the budget.
    assert _meaningful(record(running=21, kv_usage=0.41)) == base
    later = msgspec.structs.replace(record(running=20, kv_usage=0.4), updated_at=99.0)
    assert _meaningful(later) == base
    held = msgspec.structs.replace(record(running=20, kv_usage=0.4), checkpoints=CheckpointUsage(
        bytes_held=(500 << 20) + (1 << 20), budget_bytes=1 << 30))
    assert _meaningful(held) == base
    # Changes: the queue emptying, a state, a load that moved a step, bytes from 0.
    assert _meaningful(record(running=0, kv_usage=0.4)) != _meaningful(
        record(running=1, kv_usage=0.4))
    assert _meaningful(record(running=40, kv_usage=0.4)) != base
    assert _meaningful(msgspec.structs.replace(record(running=20, kv_usage=0.4),
                                               state="draining")) != base
    empty = msgspec.structs.replace(record(), checkpoints=CheckpointUsage(budget_bytes=1 << 30))
    some = msgspec.structs.replace(record(), checkpoints=CheckpointUsage(bytes_held=1,
                                                                         budget_bytes=1 << 30))
    assert _meaningful(empty) != _meaningful(some)
