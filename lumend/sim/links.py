"""Byte queues for checkpoint traffic: a fluid backlog with per-request attribution, and a
processor-sharing link for transfers that run concurrently."""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")
REL_EPS = 1e-12  # float slack, relative to the bytes carried, when a transfer is complete


class Backlog(Generic[T]):
    """A FIFO fluid queue drained at `bytes_per_s`, remembering whose bytes are still in it.

    Holder ingress: every worker streaming to one holder shares its link. `add` is O(1)
    amortised (drained entries leave from the front); `pending` says, per owner, how many of
    its bytes had not got through at a given time.
    """

    __slots__ = ("bytes_per_s", "entries", "level", "t", "total")

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.entries: deque[tuple[float, float, T]] = deque()  # (cumulative end, bytes, owner)
        self.total = 0.0  # bytes ever added
        self.level = 0.0  # bytes not yet through at time t
        self.t = 0.0

    def _drain(self, now: float) -> None:
        level = self.level - self.bytes_per_s * (now - self.t)
        self.t = now
        if level <= 0:
            self.level = 0.0
            self.entries.clear()
            return
        self.level = level
        mark = self.total - level
        entries = self.entries
        while entries and entries[0][0] <= mark:
            entries.popleft()

    def add(self, now: float, nbytes: float, owner: T) -> None:
        level = self.level - self.bytes_per_s * (now - self.t)  # _drain, inlined: hot path
        self.t = now
        entries = self.entries
        if level <= 0:
            level = 0.0
            entries.clear()
        else:
            mark = self.total - level
            while entries and entries[0][0] <= mark:
                entries.popleft()
        self.total += nbytes
        self.level = level + nbytes
        entries.append((self.total, nbytes, owner))

    def pending(self, now: float) -> dict[T, float]:
        """Bytes of each owner still queued at `now`."""
        self._drain(now)
        mark = self.total - self.level
        out: dict[T, float] = {}
        for end, nbytes, owner in self.entries:
            left = end - max(end - nbytes, mark)
            if left > 0:
                out[owner] = out.get(owner, 0.0) + left
        return out

    def clear(self) -> None:
        self.entries.clear()
        self.level = 0.0


class SharedLink(Generic[T]):
    """Processor sharing: the transfers in progress split `bytes_per_s` equally.

    Virtual time counts the bytes each active transfer has received; a transfer of n bytes
    added at virtual time v completes when virtual time reaches v + n.
    """

    __slots__ = ("bytes_per_s", "jobs", "seq", "t", "vt")

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.jobs: list[tuple[float, int, T]] = []
        self.seq = 0
        self.t = 0.0
        self.vt = 0.0

    def __len__(self) -> int:
        return len(self.jobs)

    def _advance(self, now: float) -> None:
        if self.jobs:
            self.vt += (now - self.t) * self.bytes_per_s / len(self.jobs)
        self.t = now

    def add(self, now: float, nbytes: float, item: T) -> None:
        self._advance(now)
        self.seq += 1
        heapq.heappush(self.jobs, (self.vt + nbytes, self.seq, item))

    def done(self, now: float) -> list[T]:
        """Transfers complete by `now`, removed."""
        self._advance(now)
        out: list[T] = []
        if not self.jobs:
            return out
        # Done when within float error, or under a nanosecond from done: the next event
        # time must move forward.
        slack = max(self.vt * REL_EPS, 1e-9 * self.bytes_per_s / len(self.jobs))
        while self.jobs and self.jobs[0][0] <= self.vt + slack:
            out.append(heapq.heappop(self.jobs)[2])
        return out

    def next_done_at(self) -> float | None:
        if not self.jobs:
            return None
        return self.t + (self.jobs[0][0] - self.vt) * len(self.jobs) / self.bytes_per_s

    def clear(self) -> None:
        self.jobs.clear()
