"""Epoch fencing on the receiving side: a node obeys only the coordinator etcd elected last."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

# Reads etcd: True when `epoch` is the coordinator key's create revision right now.
EpochVerifier = Callable[[int], Awaitable[bool]]


class StaleEpochError(Exception):
    def __init__(self, epoch: int, highest: int) -> None:
        self.epoch = epoch
        self.highest = highest
        super().__init__(
            f"refused a command from coordinator epoch {epoch}: epoch {highest} has been seen, "
            "so the sender is a deposed coordinator"
        )


class UnknownEpochError(StaleEpochError):
    """An epoch above the highest seen that etcd does not confirm: not a coordinator's."""

    def __init__(self, epoch: int, highest: int, why: str) -> None:
        self.why = why
        Exception.__init__(
            self,
            f"refused a command from coordinator epoch {epoch}: {why}, so no elected "
            f"coordinator sent it (the highest epoch seen stays {highest})",
        )
        self.epoch = epoch
        self.highest = highest


class EpochFence:
    """Remembers the highest coordinator epoch seen, and admits commands by it.

    The rule: a command carrying an epoch lower than the highest seen is refused (the sender
    is a deposed coordinator: epochs are etcd create revisions of the coordinator key, so they
    only grow, and one that wakes from a GC pause, SIGSTOP or a partition still carries its
    old, lower epoch). A command carrying a *higher* epoch is admitted, and raises the bar,
    only after etcd confirms that it is the coordinator key's create revision now (`verify`,
    one linearizable read); anything else is refused and leaves the bar where it was. So a
    forged or corrupted epoch (2**62) can neither be obeyed nor lock out the real coordinator.
    Epochs the HA loop reads from etcd itself (`observe`) need no confirmation.

    One event takes epochs back: etcd restored from a snapshot. Its revision returns to the
    snapshot's, so the next coordinators' epochs fall below the bar and every order of theirs
    would be refused until lumend restarts. The HA loop notices it (`rewound`): a linearizable
    read answered at a revision below the highest epoch seen, which a running etcd cannot do
    (every epoch seen was a revision etcd had committed). The bar then drops to the epoch of
    the coordinator in that read; a coordinator deposed before the restore stays refused (its
    epoch is neither that one nor confirmed by etcd).
    """

    def __init__(self, verify: EpochVerifier | None = None) -> None:
        self._highest = 0
        self._verify = verify
        self.unknown_refused = 0  # higher epochs etcd did not confirm
        self.rewinds = 0  # restores of etcd noticed (the bar dropped)

    @property
    def highest(self) -> int:
        return self._highest

    def observe(self, epoch: int) -> None:
        """An epoch read from etcd (the coordinator key's create revision)."""
        self._highest = max(self._highest, epoch)

    def rewound(self, revision: int, epoch: int | None) -> bool:
        """etcd answered a linearizable read at `revision`, with `epoch` its coordinator's
        (None: none). Below the highest epoch seen, its history went back (a restore from a
        snapshot): the bar drops to `epoch`, and True is returned."""
        if revision >= self._highest:
            return False
        log.warning("etcd answered at revision %d, below coordinator epoch %d seen before: "
                    "it was restored from a snapshot (or replaced); the fence now follows "
                    "the coordinator elected since (epoch %s)", revision, self._highest,
                    epoch if epoch is not None else "none yet")
        self._highest = epoch or 0
        self.rewinds += 1
        return True

    def check(self, epoch: int) -> None:
        """Admit a command from `epoch` by what has been seen alone: the highest seen
        passes, a lower one raises `StaleEpochError`, a higher (unconfirmed) one
        `UnknownEpochError`. `admit` confirms a higher one first."""
        if epoch < self._highest:
            raise StaleEpochError(epoch, self._highest)
        if epoch > self._highest:
            raise UnknownEpochError(epoch, self._highest, "it is higher than any seen and "
                                    "was not confirmed in etcd")

    async def admit(self, epoch: int) -> None:
        """Admit a command from `epoch`, confirming a higher one in etcd first. Raises
        `StaleEpochError` (or its `UnknownEpochError`) when refused; a `StoreError` from
        the read means etcd could not say, and nothing changed."""
        if epoch > self._highest:
            current = self._verify is not None and await self._verify(epoch)
            if not current:
                self.unknown_refused += 1
                error = UnknownEpochError(epoch, self._highest, "etcd says it is not the "
                                          "current coordinator's epoch")
                log.warning("%s", error)
                raise error
            self.observe(epoch)
        self.check(epoch)
