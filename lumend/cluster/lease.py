"""The node's one etcd lease: granted, kept alive every TTL/3, and the clock of self-fencing."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lumend.cluster.store import Store

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Holds the lease that carries this node's keys (node, workers, coordinator role).

    `confident()` is true only while the last successful renewal was *sent* less than
    `ttl - margin` ago. Measuring from the send time is conservative: etcd renewed the
    lease at some moment after that, so the lease outlives our confidence by at least
    `margin`. A coordinator acts only while confident, so it stops before its lease (and
    with it the coordinator key) can expire and another node can win.
    """

    def __init__(
        self,
        store: Store,
        ttl_s: int,
        *,
        margin_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.ttl_s = ttl_s
        self.margin_s = margin_s if margin_s is not None else max(1.0, 0.2 * ttl_s)
        self._clock = clock
        self.lease_id: int | None = None
        self._renewed_at: float | None = None

    @property
    def held(self) -> bool:
        return self.lease_id is not None

    def confident(self) -> bool:
        return self.lease_id is not None and self.seconds_since_renewal() < self.confident_for_s

    @property
    def confident_for_s(self) -> float:
        return self.ttl_s - self.margin_s

    def seconds_since_renewal(self) -> float:
        if self._renewed_at is None:
            return float("inf")
        return self._clock() - self._renewed_at

    async def grant(self) -> int:
        sent = self._clock()
        self.lease_id = await self._store.grant_lease(self.ttl_s)
        self._renewed_at = sent
        return self.lease_id

    async def renew(self) -> bool:
        """One keepalive. Returns False (and forgets the lease) when etcd says it expired."""
        lease = self.lease_id
        if lease is None:
            return False
        sent = self._clock()
        remaining = await self._store.keepalive(lease)
        if self.lease_id != lease:
            return False  # replaced while the keepalive was in flight
        if remaining <= 0:
            log.warning("etcd lease %x expired; this node's keys are gone until it re-registers",
                        lease)
            self.lease_id = None
            self._renewed_at = None
            return False
        self._renewed_at = sent
        return True

    def forget(self) -> None:
        self.lease_id = None
        self._renewed_at = None

    async def revoke(self) -> None:
        lease, self.lease_id, self._renewed_at = self.lease_id, None, None
        if lease is not None:
            await self._store.revoke_lease(lease)
