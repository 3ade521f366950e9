"""The GMS session lock's transition table, exhaustively."""

from __future__ import annotations

import itertools

import pytest

from lumend.gms.session import TRANSITIONS, Event, GmsState, IllegalTransition, admits, next_state

S, E = GmsState, Event
ALLOWED = {
    (S.EMPTY, E.WRITER_JOINS): S.RW,
    (S.RW, E.COMMIT): S.RO,
    (S.RW, E.WRITER_LEAVES): S.EMPTY,
    (S.COMMITTED, E.READER_JOINS): S.RO,
    (S.RO, E.READER_JOINS): S.RO,
    (S.RO, E.READER_LEAVES): S.RO,
    (S.RO, E.LAST_READER_LEAVES): S.COMMITTED,
}


def test_every_pair_is_either_in_the_table_or_illegal() -> None:
    assert TRANSITIONS == ALLOWED
    for state, event in itertools.product(GmsState, Event):
        if (state, event) in ALLOWED:
            assert next_state(state, event) is ALLOWED[(state, event)]
        else:
            with pytest.raises(IllegalTransition):
                next_state(state, event)


@pytest.mark.parametrize(
    ("state", "role", "granted"),
    [
        (S.EMPTY, "writer", "writer"), (S.EMPTY, "reader", None), (S.EMPTY, "auto", "writer"),
        (S.RW, "writer", None), (S.RW, "reader", None), (S.RW, "auto", None),
        (S.COMMITTED, "writer", None), (S.COMMITTED, "reader", "reader"),
        (S.COMMITTED, "auto", "reader"),
        (S.RO, "writer", None), (S.RO, "reader", "reader"), (S.RO, "auto", "reader"),
    ],
)
def test_admission(state: GmsState, role: str, granted: str | None) -> None:
    assert admits(state, role) == granted
