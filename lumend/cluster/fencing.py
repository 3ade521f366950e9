"""Epoch fencing on the receiving side: a node obeys no coordinator older than one it has seen."""

from __future__ import annotations


class StaleEpochError(Exception):
    def __init__(self, epoch: int, highest: int) -> None:
        self.epoch = epoch
        self.highest = highest
        super().__init__(
            f"refused a command from coordinator epoch {epoch}: epoch {highest} has been seen, "
            "so the sender is a deposed coordinator"
        )


class EpochFence:
    """Remembers the highest coordinator epoch seen (from etcd or from commands).

    The rule: a command carrying an epoch lower than the highest seen is refused. Epochs are
    etcd create revisions of the coordinator key, so they only grow; a deposed coordinator
    that wakes up (a GC pause, SIGSTOP, a partition) still carries its old, lower epoch.
    """

    def __init__(self) -> None:
        self._highest = 0

    @property
    def highest(self) -> int:
        return self._highest

    def observe(self, epoch: int) -> None:
        self._highest = max(self._highest, epoch)

    def check(self, epoch: int) -> None:
        """Admit a command from `epoch` (raising `StaleEpochError` if stale) and observe it."""
        if epoch < self._highest:
            raise StaleEpochError(epoch, self._highest)
        self._highest = epoch
