"""A stream's quiet-time limit at the cost of an attribute store per read.

`asyncio.timeout` around every read arms and cancels a timer each time: on a busy gateway,
where every engine stream wakes once per engine step, that was a sixth of the CPU spent on
a token. `QuietWatch` keeps one timer per quiet period instead: each read that returns data
only records when it did; the timer, when it fires, re-arms itself at the limit counted from
that moment, and cancels the reading task only when nothing came within the limit. The task
then sees `CancelledError` at its await, and `expired` tells that cancellation from any other
(as `asyncio.timeout` does, with `Task.uncancel`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class QuietWatch:
    """Cancels the current task once `limit()` seconds pass with no `heard()`. `limit` is
    read whenever the timer fires, so it may change with the stream's state (before its
    first token, between tokens, after its last)."""

    def __init__(self, limit: Callable[[], float]) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "QuietWatch is used from within a task"
        self._task = task
        self._limit = limit
        self.last = self._loop.time()
        self._fired = False
        self._due = self.last + limit()
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self._due, self._check)

    def heard(self) -> None:
        """Data came: the quiet period starts again now (and, where the limit has become
        shorter, e.g. after the first token, the timer is brought forward)."""
        self.last = now = self._loop.time()
        due = now + self._limit()
        if due < self._due and self._handle is not None:
            self._handle.cancel()
            self._due = due
            self._handle = self._loop.call_at(due, self._check)

    def _check(self) -> None:
        due = self.last + self._limit()
        if self._loop.time() < due:
            self._due = due
            self._handle = self._loop.call_at(due, self._check)
            return
        self._handle = None
        self._fired = True
        self._task.cancel()

    def expired(self) -> bool:
        """Whether the `CancelledError` being handled is this watch's doing (and then it
        is consumed: the task is no longer being cancelled). False for a cancellation from
        elsewhere, even one that came with it, which must propagate."""
        if not self._fired:
            return False
        self._fired = False
        return self._task.uncancel() == 0

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
