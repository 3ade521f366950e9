"""The GMS session lock: one writer or many readers, as one explicit state machine.

    state      event                -> state      meaning
    EMPTY      writer_joins         -> RW         a writer starts loading weights
    RW         commit               -> RO         layout published; the writer reads on
    RW         writer_leaves        -> EMPTY      died or left before commit: layout aborted
    COMMITTED  reader_joins         -> RO
    RO         reader_joins         -> RO
    RO         reader_leaves        -> RO         others still read
    RO         last_reader_leaves   -> COMMITTED  weights stay in place for the next engine

Any other (state, event) pair is a bug and raises. Admission: a writer is admitted only
in EMPTY; a reader only in COMMITTED or RO. An `auto` session (what engines use) becomes
the writer when there is nothing to read and a reader otherwise, waiting while another
writer loads, so two engines starting together load the weights once.
"""

from __future__ import annotations

import enum


class GmsState(enum.Enum):
    EMPTY = "empty"
    RW = "rw"
    COMMITTED = "committed"
    RO = "ro"


class Event(enum.Enum):
    WRITER_JOINS = "writer_joins"
    COMMIT = "commit"
    WRITER_LEAVES = "writer_leaves"
    READER_JOINS = "reader_joins"
    READER_LEAVES = "reader_leaves"
    LAST_READER_LEAVES = "last_reader_leaves"


TRANSITIONS: dict[tuple[GmsState, Event], GmsState] = {
    (GmsState.EMPTY, Event.WRITER_JOINS): GmsState.RW,
    (GmsState.RW, Event.COMMIT): GmsState.RO,
    (GmsState.RW, Event.WRITER_LEAVES): GmsState.EMPTY,
    (GmsState.COMMITTED, Event.READER_JOINS): GmsState.RO,
    (GmsState.RO, Event.READER_JOINS): GmsState.RO,
    (GmsState.RO, Event.READER_LEAVES): GmsState.RO,
    (GmsState.RO, Event.LAST_READER_LEAVES): GmsState.COMMITTED,
}


class IllegalTransition(Exception):
    pass


def next_state(state: GmsState, event: Event) -> GmsState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"GMS: {event.value} is not allowed in state "
                                f"{state.value}") from None


def admits(state: GmsState, role: str) -> str | None:
    """The role granted to a session asking for `role` now, or None if it must wait."""
    if role == "writer":
        return "writer" if state is GmsState.EMPTY else None
    if role == "reader":
        return "reader" if state in (GmsState.COMMITTED, GmsState.RO) else None
    if role == "auto":
        if state is GmsState.EMPTY:
            return "writer"
        if state in (GmsState.COMMITTED, GmsState.RO):
            return "reader"
        return None
    raise ValueError(f"unknown GMS role {role!r}")
