"""Workers ranked by a load key, kept in order per change: argmin without rescanning them.

One job: answer the two argmins an admission asks (issue 16) with the very index the
policy's full scans over the load book's columns return, at a cost per admission that does
not grow with the workers.

* `Ranking` keeps `(key, index)` pairs sorted. Its owner marks an index whenever an input of
  its key changes; the marked ones are re-keyed and moved (bisect) before the next read, so
  a change costs O(log W) and a read O(1) plus the changes since the last one.
* `first_alive`: `policy.least_loaded` over a mask (the admission: the shortest queue, or
  the least L_hat): the first ranked index the mask lets through. Ties go to the lowest
  index, as the scan's `min` then `index`.
* The load book walks the same order for Algorithm 1 (`LoadBook.holder`), with keys that
  bound from below the values that decision compares.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence

Order = list[tuple[float, int]]


class Ranking:
    """Indices sorted by `key(index)`; `mark` an index when its key's inputs change."""

    def __init__(self, key: Callable[[int], float], members: Iterable[int]) -> None:
        self._key = key
        self._keys = {i: key(i) for i in members}
        self._order: Order = sorted((k, i) for i, k in self._keys.items())
        self._marked: set[int] = set()

    def mark(self, index: int) -> None:
        self._marked.add(index)

    def order(self) -> Order:
        """Every member as `(key, index)`, ascending, with the marked ones re-keyed."""
        marked = self._marked
        if marked:
            keys, order, key = self._keys, self._order, self._key
            if len(marked) * 8 > len(order):  # many moved: one sort is cheaper
                for i in marked:
                    if i in keys:
                        keys[i] = key(i)
                order[:] = sorted((k, i) for i, k in keys.items())
            else:
                for i in marked:
                    old = keys.get(i)
                    if old is None:  # not a member
                        continue
                    new = key(i)
                    if new != old:
                        del order[bisect.bisect_left(order, (old, i))]
                        bisect.insort(order, (new, i))
                        keys[i] = new
            marked.clear()
        return self._order


def first_alive(order: Order, alive: Sequence[bool]) -> int | None:
    """The index `policy._argmin` picks over the keys with the dead masked to +inf."""
    for value, i in order:
        if alive[i]:
            return i if value != float("inf") else None
    return None

