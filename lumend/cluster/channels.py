"""The etcd store's gRPC channels: made per endpoint, lent to calls, retired when calls on
them fail twice in a row, and closed off the event loop once no call uses them any more.

Why a room of its own: grpc's `Channel.close()` can deadlock when it races calls in flight
on the same channel or a close in another thread (grpc/grpc#19910, #20026). lumend's HA
loop and its lease-renewal thread share one store; both retired the channel a failed call
had used by closing it at once, on their own event loops. After a long black hole between
a node and etcd (the chaos lab, 90 s) a node could freeze for good that way: no renewal, no
re-registration after the network healed. Here a retired channel is closed only when its
last call has returned, by one closer thread, so neither event loop ever waits on a close
and no channel is closed under a call.

Every channel is made with its own subchannel pool: a new channel is a new connection,
which inherits no reconnect backoff from the channel it replaces (grpc shares subchannels
between channels by default, and their backoff grows to two minutes).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from asyncio import Future
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# grpc channel arguments of every etcd channel (see the module's docstring).
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

# Failed calls in a row after which a channel is replaced by a fresh one (a new connection).
RETIRE_AFTER_FAILURES = 2

# A close that takes longer than this is reported (it is then likely one of grpc's
# deadlocks: the closer thread is lost, later channels are left open, nothing else waits).
SLOW_CLOSE_S = 10.0


@dataclass(eq=False)
class Lease:
    """One channel (a pyetcd client) and the calls using it."""

    index: int
    client: Any
    users: int = 0
    retired: bool = False
    failures: int = 0  # calls failed on it in a row


class ChannelPool:
    """The current client per endpoint index; `make(index)` builds one when there is none."""

    def __init__(self, make: Callable[[int], Any]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._current: dict[int, Lease] = {}
        # The closer thread and its own queue (a closer `drain` stopped may still be
        # closing while a later retirement starts the next one; they never share a queue).
        self._closer: tuple[threading.Thread, queue.SimpleQueue[Lease | None]] | None = None
        # Guards `_closer`: release callbacks (any thread) and `drain` race to start or
        # stop it; a closer is published only once started.
        self._closer_lock = threading.Lock()
        self._close_started: float | None = None
        self.made = 0
        self.closed = 0
        self.abandoned = 0

    @contextmanager
    def lend(self, index: int) -> Iterator[Lease]:
        """The endpoint's current channel, kept open until the block ends. A `make` failure
        (the channel cannot be built) propagates; nothing is lent then."""
        with self._lock:
            lease = self._current.get(index)
            if lease is None:
                lease = Lease(index, self._make(index))
                self._current[index] = lease
                self.made += 1
            lease.users += 1
        try:
            yield lease
        finally:
            with self._lock:
                lease.users -= 1
                close = lease.retired and lease.users == 0
            if close:
                self._close_later(lease)

    def keep_while(self, lease: Lease, call: Future[Any]) -> None:
        """Keep `lease`'s channel open until `call` is done (a call whose caller was
        cancelled still runs in its thread)."""
        with self._lock:
            lease.users += 1

        def release(_: Future[Any]) -> None:
            with self._lock:
                lease.users -= 1
                close = lease.retired and lease.users == 0
            if close:
                self._close_later(lease)

        call.add_done_callback(release)

    def failed(self, lease: Lease) -> None:
        """A call on `lease` failed: the second failure in a row retires it. One failure
        keeps it: on a lossy link the connection is alive and a new one costs a handshake
        whose lost SYN waits 1-3 s; a connection that died (a black hole) fails again."""
        with self._lock:
            lease.failures += 1
            retire = lease.failures >= RETIRE_AFTER_FAILURES
        if retire:
            self.retire(lease)

    def succeeded(self, lease: Lease) -> None:
        lease.failures = 0

    def retire(self, lease: Lease) -> None:
        """No new call gets `lease`'s channel; it is closed when its last call returns."""
        with self._lock:
            if self._current.get(lease.index) is lease:
                del self._current[lease.index]
            if lease.retired:
                return
            lease.retired = True
            close = lease.users == 0
        if close:
            self._close_later(lease)

    def abandon(self, lease: Lease) -> None:
        """A call on `lease` never returned: retire the channel and never close it (a close
        would wait on that call)."""
        with self._lock:
            self.abandoned += 1
            lease.users += 1_000_000  # never reaches zero: the channel stays open
        self.retire(lease)

    def retire_all(self) -> None:
        with self._lock:
            leases = list(self._current.values())
        for lease in leases:
            self.retire(lease)

    def _close_later(self, lease: Lease) -> None:
        started = self._close_started
        if started is not None and time.monotonic() - started > SLOW_CLOSE_S:
            log.warning("closing an etcd channel has taken %.0f s (a grpc deadlock?); channels "
                        "retired since are left open", time.monotonic() - started)
        with self._closer_lock:
            if self._closer is None:
                closing: queue.SimpleQueue[Lease | None] = queue.SimpleQueue()
                thread = threading.Thread(target=self._close_forever, args=(closing,),
                                          name="etcd-closer", daemon=True)
                thread.start()
                self._closer = (thread, closing)
            self._closer[1].put(lease)

    def _close_forever(self, closing: queue.SimpleQueue[Lease | None]) -> None:
        while True:
            lease = closing.get()
            if lease is None:
                return
            self._close_started = time.monotonic()
            try:
                lease.client.close()
            except Exception:  # closing a broken channel must not end the closer
                log.debug("closing the etcd channel of endpoint %d failed", lease.index,
                          exc_info=True)
            finally:
                self._close_started = None
                self.closed += 1

    def drain(self, timeout_s: float) -> None:
        """Retire every channel and wait up to `timeout_s` for the closes queued so far."""
        self.retire_all()
        with self._closer_lock:
            closer, self._closer = self._closer, None
        if closer is None:
            return
        thread, closing = closer
        closing.put(None)
        thread.join(timeout_s)
