"""The admission's rankings (lumend.coordinator.ranking): in order after any changes, and a
read re-keys only the members marked since the last one (what keeps an admission's cost
from growing with the workers)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lumend.coordinator.ranking import Ranking, first_alive

changes = st.lists(st.lists(st.tuples(st.integers(0, 39), st.integers(0, 6)), max_size=12),
                   max_size=30)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=40), changes)
def test_the_order_is_a_full_sort_after_any_changes(
        start: list[int], rounds: list[list[tuple[int, int]]]) -> None:
    values = [float(v) for v in start]
    members = [i for i in range(len(values)) if i % 5 != 4]  # some indices are not ranked
    rank = Ranking(values.__getitem__, members)
    for changed in rounds:
        for i, v in changed:
            if i < len(values):
                values[i] = float(v)
                rank.mark(i)
        assert rank.order() == sorted((values[i], i) for i in members)


def test_a_read_re_keys_the_marked_members_only() -> None:
    values = [float(i % 7) for i in range(64)]
    asked: list[int] = []

    def key(i: int) -> float:
        asked.append(i)
        return values[i]

    rank = Ranking(key, range(64))
    asked.clear()
    values[9] += 3
    rank.mark(9)
    rank.mark(70)  # not a member: ignored
    rank.order()
    assert asked == [9]
    asked.clear()
    rank.order()  # nothing changed since
    assert asked == []
    # Control: the same read after every member changed asks every key again.
    for i in range(64):
        rank.mark(i)
    rank.order()
    assert sorted(asked) == list(range(64))


def test_the_first_alive_is_the_scans_argmin() -> None:
    rank = Ranking([3.0, 1.0, 1.0, 0.0].__getitem__, range(4))
    order = rank.order()
    assert first_alive(order, [True] * 4) == 3
    assert first_alive(order, [True, True, True, False]) == 1  # ties: the lowest index
    assert first_alive(order, [True, False, True, False]) == 2
    assert first_alive(order, [False] * 4) is None
