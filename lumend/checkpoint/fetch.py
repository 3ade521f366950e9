"""A checkpoint's pages fetched without waiting: one resumed request's restore, advanced a
little at a time by a caller that must not block (vLLM's worker, between two forwards).

`advance()` takes the replies already here and keeps up to `window` GETs in flight (one
round trip per page would bound a restore by the latency, not the bandwidth). A page the
holder does not have, or of the wrong size, ends the usable prefix: the pages after it are
useless to a resume (a holder matches consecutive blocks only). A fetch ends there too,
and says so (`timed_out`), when its holder has answered nothing, to it or to another fetch
on the same streamer, for `timeout_s`: fetches from one holder queue behind each other
there, and a holder busy answering the others is not a silent one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from lumend.checkpoint import wire
from lumend.checkpoint.streamer import CheckpointStreamer, FetchedPage


class PageFetch:
    def __init__(self, streamer: CheckpointStreamer, ckpt_id: str,
                 hashes: Sequence[bytes | str], *, tp_rank: int | None = None,
                 window: int = 16, timeout_s: float = 1.0,
                 page_nbytes: int | None = None) -> None:
        """`page_nbytes`: the size every page must have (None: any)."""
        self.streamer = streamer
        self.ckpt_id = ckpt_id
        self._hashes = list(hashes)
        self._tp_rank = tp_rank
        self._window = max(1, window)
        self._timeout_s = timeout_s
        self._page_nbytes = page_nbytes
        self._pending: dict[int, int] = {}  # call -> index into hashes
        self._sent = 0
        self._received: set[int] = set()
        self._usable = 0  # pages 0.._usable-1 arrived
        self.limit = len(self._hashes)  # the first index known missing
        self.timed_out = False
        self.cancelled = False
        self._deadline = time.monotonic() + timeout_s

    @property
    def done(self) -> bool:
        return self._ended()

    def _ended(self) -> bool:  # a method too: mypy narrows a property read twice in advance()
        return self.cancelled or self.timed_out or self._usable >= self.limit

    @property
    def usable(self) -> int:
        """Pages 0..usable-1 arrived (once done: the restore's usable prefix)."""
        return min(self._usable, self.limit)

    def wait_s(self) -> float:
        """How long a caller that can wait should wait for the next reply."""
        return max(0.0, self._deadline - time.monotonic())

    @property
    def in_flight(self) -> int:
        """GETs sent and not answered yet."""
        return len(self._pending)

    def advance(self, max_in_flight: int | None = None) -> dict[int, FetchedPage]:
        """The pages that arrived since the last call (index -> page, only below the first
        page known missing), after sending the GETs the window allows (and at most
        `max_in_flight` in flight: a caller sharing a budget among fetches). Never waits."""
        if self._ended():
            return {}
        arrived: dict[int, FetchedPage] = {}
        replies = self.streamer.answers(list(self._pending)) if self._pending else {}
        for call, reply in replies.items():
            index = self._pending.pop(call)
            if self._is_page(reply):
                assert reply.payload is not None
                self._received.add(index)
                if index < self.limit:
                    arrived[index] = FetchedPage(reply.header, reply.payload)
            else:
                self.limit = min(self.limit, index)
        while self._usable in self._received:
            self._usable += 1
        now = time.monotonic()
        if replies:
            self._deadline = now + self._timeout_s
        for call, index in list(self._pending.items()):
            if index >= self.limit:  # after a missing page: useless, and holds the window
                self.streamer.forget(call)
                del self._pending[call]
        window = self._window if max_in_flight is None else min(self._window, max_in_flight)
        self._send(window)
        if not self._pending:  # nothing asked (a budget shared with others): no one is late
            self._deadline = now + self._timeout_s
        self._deadline = max(self._deadline, self.streamer.last_reply_at + self._timeout_s)
        if self._ended():
            self._forget_pending()
        elif now > self._deadline:
            self.timed_out = True
            self.streamer.counters.timeouts += 1
            self.limit = self._usable
            self._forget_pending()
        return {i: page for i, page in arrived.items() if i < self.limit}

    def cancel(self) -> None:
        """Stop fetching (the request ended): replies still coming are dropped."""
        self.cancelled = True
        self._forget_pending()

    def _is_page(self, reply: wire.Message) -> bool:
        if reply.header.op != wire.ACK or reply.payload is None:
            return False
        return self._page_nbytes is None or reply.payload.nbytes == self._page_nbytes

    def _send(self, window: int) -> None:
        while self._sent < self.limit and len(self._pending) < window:
            call = self.streamer.ask_get(self.ckpt_id, self._hashes[self._sent],
                                         tp_rank=self._tp_rank)
            if call is None:
                return  # the send queue is full: the next advance sends the rest
            self._pending[call] = self._sent
            self._sent += 1

    def _forget_pending(self) -> None:
        for call in self._pending:
            self.streamer.forget(call)
        self._pending.clear()
