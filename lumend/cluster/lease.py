"""The node's one etcd lease: granted, kept alive every TTL/3, and the clock of self-fencing.

Two rules make the lease safe to lead on (issue 14 item 4, issue 16):
* Confidence is measured on a clock that counts a suspended host (CLOCK_BOOTTIME on Linux):
  `time.monotonic` stops while the host sleeps, so after a resume it would claim a lease
  that etcd let expire long ago.
* The keepalive does not wait behind admissions. With the etcd store the lease is renewed
  from a thread of its own (its own event loop, its own schedule), so a busy event loop
  (thousands of Admit calls queued) delays no renewal. The thread renews only while the
  event loop answers its pings: a loop that is wedged must let the lease lapse, so that
  another node takes over a coordinator that cannot act.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from lumend.cluster.store import EtcdStore, Store, StoreError

log = logging.getLogger(__name__)

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def boottime() -> float:
    """Seconds on a clock that keeps counting while the host is suspended (CLOCK_BOOTTIME;
    `time.monotonic` where the platform has none)."""
    if _BOOTTIME is None:
        return time.monotonic()
    return time.clock_gettime(_BOOTTIME)


# The keepers of this process by the lease they hold: the coordinator's RPC handlers find
# the lease of their term here (lumend.rpc.server).
_KEEPERS: weakref.WeakValueDictionary[int, LeaseKeeper] = weakref.WeakValueDictionary()


def keeper_of(lease_id: int | None) -> LeaseKeeper | None:
    """The keeper holding `lease_id` in this process; with None, the process's only keeper
    holding a lease (None when there are several or none)."""
    if lease_id is not None:
        return _KEEPERS.get(lease_id)
    keepers = list(_KEEPERS.values())
    return keepers[0] if len(keepers) == 1 else None


class LeaseKeeper:
    """Holds the lease that carries this node's keys (node, workers, coordinator role).

    `confident()` is true only while the last successful renewal was *sent* less than
    `ttl - margin` ago. Measuring from the send time is conservative: etcd renewed the
    lease at some moment after that, so the lease outlives our confidence by at least
    `margin`. A coordinator acts only while confident, so it stops before its lease (and
    with it the coordinator key) can expire and another node can win. `time.monotonic`
    given as the clock is replaced by `boottime` (the suspend-counting clock).
    """

    def __init__(
        self,
        store: Store,
        ttl_s: int,
        *,
        margin_s: float | None = None,
        clock: Callable[[], float] = boottime,
        renew_in_thread: bool | None = None,
    ) -> None:
        self._store = store
        self.ttl_s = ttl_s
        self.margin_s = margin_s if margin_s is not None else max(1.0, 0.2 * ttl_s)
        self._clock = boottime if clock is time.monotonic else clock
        self.lease_id: int | None = None
        self._renewed_at: float | None = None
        self.interval_s = ttl_s / 3
        # The etcd store is renewed from a thread; test doubles (bound to the caller's loop)
        # are renewed where `renew` is awaited.
        self._threaded = isinstance(store, EtcdStore) if renew_in_thread is None \
            else renew_in_thread
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pong_at: float | None = None
        self._ping_at: float | None = None  # when the renewal thread's last ping was posted
        self._thread_error: StoreError | None = None
        # Renewal lag: gaps between successive successful renewals (send times).
        self._last_sent: float | None = None
        self.gaps: deque[float] = deque(maxlen=4096)
        self.max_gap_s = 0.0
        self.renewals = 0

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

    @property
    def lag_s(self) -> float:
        """The longest a renewal came later than its schedule (every TTL/3), so far."""
        return max(0.0, self.max_gap_s - self.interval_s)

    async def grant(self) -> int:
        sent = self._clock()
        lease = await self._store.grant_lease(self.ttl_s)
        self._forget_id()
        self.lease_id = lease
        self._renewed_at = sent
        self._last_sent = sent
        _KEEPERS[lease] = self
        if self._threaded:
            self._start_thread(asyncio.get_running_loop())
        return lease

    async def renew(self) -> bool:
        """One keepalive. Returns False (and forgets the lease) when etcd says it expired.
        While the renewal thread runs, this reports its outcome instead (raising the error
        of its last failed keepalive, once), and answers its ping."""
        if self._thread is not None and self._thread.is_alive():
            self._pong()
            if self.lease_id is not None and self.seconds_since_renewal() > self.ttl_s:
                # etcd has let it expire by now (or will, unrenewed): re-register with a new
                # lease rather than wait for a keepalive to come back and say so, which a
                # wedged call never does. Safe if it still lives: nothing renews it, and
                # the coordinator key it may carry is not ours under a new lease.
                log.warning("lease %x not renewed for %.1f s (ttl %d s): taken as expired; "
                            "this node re-registers with a new lease", self.lease_id,
                            self.seconds_since_renewal(), self.ttl_s)
                self._forget_id()
                return False
            error, self._thread_error = self._thread_error, None
            if error is not None:
                raise error
            return self.lease_id is not None
        lease = self.lease_id
        if lease is None:
            return False
        sent = self._clock()
        remaining = await self._store.keepalive(lease)
        return self._renewed(lease, sent, remaining)

    def _renewed(self, lease: int, sent: float, remaining: int) -> bool:
        if self.lease_id != lease:
            return False  # replaced while the keepalive was in flight
        if remaining <= 0:
            log.warning("etcd lease %x expired; this node's keys are gone until it re-registers",
                        lease)
            self._forget_id()
            return False
        if self._last_sent is not None:
            gap = sent - self._last_sent
            self.gaps.append(gap)
            self.max_gap_s = max(self.max_gap_s, gap)
        self._last_sent = sent
        self._renewed_at = sent
        self.renewals += 1
        return True

    def _forget_id(self) -> None:
        lease = self.lease_id
        if lease is not None and _KEEPERS.get(lease) is self:
            del _KEEPERS[lease]
        self.lease_id = None
        self._renewed_at = None
        self._last_sent = None

    def forget(self) -> None:
        self._forget_id()

    async def revoke(self) -> None:
        self._closing.set()
        lease = self.lease_id
        self._forget_id()
        if lease is not None:
            await self._store.revoke_lease(lease)

    # -- the renewal thread -----------------------------------------------------------------

    def _start_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pong_at = self._clock()
        if self._thread is not None and self._thread.is_alive():
            return
        self._closing.clear()
        self._thread = threading.Thread(target=self._renew_forever, name="lease-renewal",
                                        daemon=True)
        self._thread.start()

    def _pong(self) -> None:
        self._pong_at = self._clock()

    def _loop_answers(self) -> bool:
        """Whether the event loop answered the last ping, or it has been waiting for less
        than the limit (an interval plus half the confidence). Judged by the ping's own send
        time: a keepalive that is merely slow (a lossy link) delays the next round, which
        does not make the loop late (taken for a stall, it cost a renewal)."""
        ping = self._ping_at
        if ping is None or self._answered():
            return True
        return self._clock() - ping < self.interval_s + self.confident_for_s / 2

    def _answered(self) -> bool:
        return (self._ping_at is not None and self._pong_at is not None
                and self._pong_at >= self._ping_at)

    def _renew_forever(self) -> None:
        loop = asyncio.new_event_loop()
        stalled = False
        try:
            while not self._closing.is_set():
                started = self._clock()
                main = self._loop
                if main is None or main.is_closed():
                    return
                answers = self._loop_answers()  # the ping still out, if any
                waited = self._clock() - (self._ping_at or self._clock())
                if answers and (self._ping_at is None or self._answered()):
                    # A new ping only once the last was answered: one left unanswered keeps
                    # its send time, so a wedged loop is seen however slow the rounds are.
                    self._ping_at = self._clock()
                    with contextlib.suppress(RuntimeError):  # closing: the next check ends us
                        main.call_soon_threadsafe(self._pong)
                lease = self.lease_id
                if lease is not None and answers:
                    stalled = False
                    sent = self._clock()
                    try:
                        remaining = loop.run_until_complete(self._store.keepalive(lease))
                    except StoreError as exc:
                        self._thread_error = exc
                    else:
                        self._renewed(lease, sent, remaining)
                elif lease is not None and not stalled:
                    stalled = True
                    log.warning("the event loop has not answered for %.1f s: lease %x is not "
                                "renewed, so it lapses and another node can take over",
                                waited, lease)
                # The next renewal is due one interval after this one was sent.
                self._closing.wait(max(0.0, self.interval_s - (self._clock() - started)))
        finally:
            loop.close()
