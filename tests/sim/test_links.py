from __future__ import annotations

import pytest

from lumend.sim.links import Backlog, SharedLink


def test_backlog_drains_at_its_rate_and_attributes_what_is_left_fifo() -> None:
    q: Backlog[str] = Backlog(bytes_per_s=100.0)
    q.add(0.0, 100.0, "a")
    q.add(0.0, 100.0, "b")
    # After 1.5 s, 150 bytes went through: all of a's, half of b's.
    assert q.pending(1.5) == {"b": pytest.approx(50.0)}
    assert q.pending(2.0) == {}
    # Negative control: with nothing drained, both owners have everything pending.
    fresh: Backlog[str] = Backlog(bytes_per_s=100.0)
    fresh.add(3.0, 10.0, "a")
    fresh.add(3.0, 30.0, "b")
    fresh.add(3.0, 5.0, "a")
    assert fresh.pending(3.0) == {"a": pytest.approx(15.0), "b": pytest.approx(30.0)}


def test_backlog_shared_by_two_sources_holds_more_than_one_source_alone() -> None:
    # Each source sends 80 bytes/s into a 100 bytes/s holder link, in 0.1 s bursts.
    def left(sources: int) -> float:
        q: Backlog[int] = Backlog(bytes_per_s=100.0)
        for k in range(1, 21):
            for s in range(sources):
                q.add(k * 0.1, 8.0, s)
        return sum(q.pending(2.0).values())

    assert left(1) == pytest.approx(8.0)  # only the last burst is in flight
    assert left(2) > 3 * left(1)          # 160 bytes/s into 100: a queue builds


def test_backlog_forgets_drained_entries() -> None:
    q: Backlog[int] = Backlog(bytes_per_s=1e9)
    for k in range(10_000):
        q.add(float(k), 10.0, k)
    assert len(q.entries) == 1


def test_shared_link_splits_bandwidth_between_concurrent_transfers() -> None:
    link: SharedLink[str] = SharedLink(bytes_per_s=100.0)
    link.add(0.0, 100.0, "a")
    assert link.next_done_at() == pytest.approx(1.0)  # alone: 100 bytes at 100 B/s
    link.add(0.0, 100.0, "b")
    assert link.next_done_at() == pytest.approx(2.0)  # two at once: each at 50 B/s
    assert link.done(1.99) == []
    assert sorted(link.done(2.0)) == ["a", "b"]
    assert link.next_done_at() is None


def test_shared_link_late_arrival_and_short_transfer_overtakes() -> None:
    link: SharedLink[str] = SharedLink(bytes_per_s=100.0)
    link.add(0.0, 200.0, "long")
    link.add(1.0, 20.0, "short")  # long has 100 left; both at 50 B/s from t=1
    assert link.next_done_at() == pytest.approx(1.4)
    assert link.done(1.4) == ["short"]
    # long: 100 - 20 = 80 bytes left at t=1.4, alone again at 100 B/s.
    assert link.next_done_at() == pytest.approx(2.2)
    assert link.done(2.2) == ["long"]
