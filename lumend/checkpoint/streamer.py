"""The engine side of checkpointing: stream KV pages to one holder, never blocking decode.

`put_block` hands a page to ZeroMQ without waiting and without copying it; when the holder
or the network cannot keep up (the send high-water mark is reached, or no holder is
connected) the block is dropped, counted, and its checkpoint marked incomplete: coverage
falls, decode latency does not. Later blocks of an incomplete checkpoint are not sent
either, because a holder matches consecutive blocks only and they would be useless.

A new holder's first connection takes a TCP and ZMTP (CurveZMQ) handshake, longer on a busy
node: with `connect_grace_s` the pages put before it are held, in order and up to the
high-water mark, and sent once it is up (`flush`, or the next `put_block`); only when the
grace passes without a connection are they dropped. After the first connection nothing is
held: a holder that goes away loses the blocks put meanwhile at once.

ACKs from the holder say how far each checkpoint has reached; they are read, without
waiting, on every call. `lookup` and `get` serve the resume side; they wait (with a timeout)
on a socket of their own, so a full stream never delays a resume. `ask` and `answer` split
a call for a caller that must not wait (`ask_lookup`, `ask_get`; `lumend.checkpoint.fetch`
fetches a checkpoint's pages that way): vLLM's scheduler and worker, which a holder that
does not answer would otherwise stall for every request resumed from it.

Not thread-safe: use one streamer per thread (ZeroMQ sockets are not shareable).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from lumend.checkpoint import wire
from lumend.checkpoint.security import CurveKeys
from lumend.checkpoint.wire import Header, WireError

# What an engine's streamer holds pages for a new holder's first connection: long enough for
# a handshake on a busy node, short enough that a holder that never comes costs little memory.
ENGINE_CONNECT_GRACE_S = 10.0


@dataclass(frozen=True)
class PageLayout:
    """What every page this engine streams shares (part of each header)."""

    model: str
    layout_fingerprint: str
    dtype: str
    page_shape: tuple[int, ...]
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def page_nbytes(self) -> int:
        return wire.page_nbytes(self.dtype, self.page_shape)


@dataclass
class CheckpointProgress:
    """How far one checkpoint has reached, as this streamer knows it."""

    sent: int = 0          # blocks handed to ZeroMQ
    dropped: int = 0       # blocks not sent (back-pressure, no holder, or after a gap)
    reached: int = 0       # holder's ACK: blocks 0..reached-1 held on this rank
    refused: str = ""      # the holder's reason when it refused this checkpoint
    finished: bool = False
    held: int = 0          # blocks waiting for the holder's first connection

    @property
    def complete(self) -> bool:
        """Every block sent so far is held (as far as the ACKs read so far say)."""
        return self.intact and self.reached == self.sent

    @property
    def intact(self) -> bool:
        """No block dropped and none refused so far, and none waiting for the holder's
        first connection (ACKs still on their way are trusted): what an engine's
        `lumen_ckpt_requests_complete` counts."""
        return not self.lost and not self.held

    @property
    def lost(self) -> bool:
        """A block of it was dropped or refused: the checkpoint stops where the gap is."""
        return bool(self.dropped or self.refused)


@dataclass
class StreamerCounters:
    sent: int = 0
    dropped: int = 0
    acks: int = 0
    refusals: int = 0
    timeouts: int = 0  # calls whose (next) reply did not come in time
    errors: dict[str, int] = field(default_factory=dict)


class StreamedTally:
    """Pages a set of streamers sent and dropped since the last call: what an engine adds to
    its blocks saved / dropped counters (a held page counts when it is sent or dropped)."""

    def __init__(self) -> None:
        self._seen = (0, 0)

    def since_last(self, streamers: Iterable[CheckpointStreamer]) -> tuple[int, int]:
        sent = dropped = 0
        for streamer in streamers:
            sent += streamer.counters.sent
            dropped += streamer.counters.dropped
        delta = (sent - self._seen[0], dropped - self._seen[1])
        self._seen = (sent, dropped)
        return delta


@dataclass(frozen=True)
class FetchedPage:
    header: Header
    data: memoryview


class CheckpointStreamer:
    def __init__(self, endpoint: str, layout: PageLayout, *, sndhwm: int = 64,
                 context: zmq.Context[Any] | None = None,
                 curve: CurveKeys | None = None, connect_grace_s: float = 0.0) -> None:
        """`curve`: the cluster's keys (`client_keys_from_env()` in engines); without them
        a secure holder refuses this streamer: every block is then dropped.
        `connect_grace_s`: how long pages put before the holder's first connection are
        held for it (0: dropped at once)."""
        self.endpoint = endpoint
        self.layout = layout
        self.curve = curve
        self._context = context or zmq.Context.instance()
        self._sndhwm = sndhwm
        self._stream = self._socket(sndhwm, immediate=True)
        self._ever_connected = False
        self._grace_until = time.monotonic() + connect_grace_s
        # Pages put while the first connection is pending: (checkpoint, frames), in order.
        self._held: deque[tuple[str, list[Any]]] = deque()
        self._rpc: zmq.Socket[Any] | None = None
        self._seq = itertools.count(1)
        # `ask` calls not handed out yet: seq -> the reply once it came
        self._awaited: dict[int, wire.Message | None] = {}
        self.last_reply_at = float("-inf")  # when the holder last answered any call
        self.progress: dict[str, CheckpointProgress] = {}
        self.counters = StreamerCounters()

    def _socket(self, sndhwm: int, immediate: bool) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        # The stream queues only to a connected holder: with no holder a block is dropped
        # at once instead of pinning its page in a queue for a holder that may not return.
        sock.setsockopt(zmq.IMMEDIATE, int(immediate))
        if self.endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        if self.curve is not None:
            self.curve.connect_as_client(sock)
        sock.connect(self.endpoint)
        return sock

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait until the holder is connected (blocks put before that are dropped, or held
        within the connect grace)."""
        if not self._ever_connected and self._stream.poll(int(timeout_s * 1000), zmq.POLLOUT):
            self._ever_connected = True
        return self._ever_connected

    def _first_connection_pending(self) -> bool:
        """Within the connect grace and not connected yet (pages put now are held)."""
        if self._ever_connected or time.monotonic() >= self._grace_until:
            return False
        return not self.wait_connected(0)

    @property
    def never_connected(self) -> bool:
        """The connect grace passed without the holder ever connecting."""
        return not self._ever_connected and time.monotonic() >= self._grace_until

    @property
    def held(self) -> int:
        """Pages held for the holder's first connection."""
        return len(self._held)

    def flush(self) -> None:
        """Send the pages held for the first connection once the holder is up; drop them
        (counted) once the grace has passed without it. Cheap when nothing is held."""
        if not self._held or self._first_connection_pending():
            return
        while self._held:
            ckpt_id, frames = self._held.popleft()
            progress = self.progress.get(ckpt_id)
            if progress is None:
                continue  # the request ended meanwhile: its checkpoint is freed
            progress.held -= 1
            if self._ever_connected:
                self._send(progress, frames)
            else:
                self._drop(progress)

    # -- streaming (never blocks) ---------------------------------------------------------

    def put_block(self, *, ckpt_id: str, request_id: str, worker: str, block_index: int,
                  block_hash: bytes | str, page: Any, token_count: int) -> bool:
        """Queue one page (any buffer of `layout.page_nbytes` bytes); False when dropped.

        The page is not copied: it must not change until ZeroMQ has sent it (stage it in a
        buffer of its own when the source is reused).
        """
        view = memoryview(page)
        if view.nbytes != self.layout.page_nbytes:
            raise ValueError(f"page of {view.nbytes} bytes; the layout says "
                             f"{self.layout.page_nbytes} ({self.layout.dtype} x "
                             f"{list(self.layout.page_shape)})")
        self.poll_acks()
        progress = self.progress.setdefault(ckpt_id, CheckpointProgress())
        if progress.lost or progress.finished:
            return self._drop(progress)
        self.flush()
        lay = self.layout
        header = wire.request(
            wire.PUT, ckpt_id=ckpt_id, request_id=request_id, worker=worker,
            model=lay.model, layout_fingerprint=lay.layout_fingerprint, tp_rank=lay.tp_rank,
            tp_size=lay.tp_size, block_index=block_index, block_hash=block_hash,
            token_count=token_count, dtype=lay.dtype, page_shape=list(lay.page_shape),
        )
        frames = wire.frames(header, view)
        if self._first_connection_pending():
            if len(self._held) >= self._sndhwm:
                return self._drop(progress)
            self._held.append((ckpt_id, frames))
            progress.held += 1
            return True
        return self._send(progress, frames)

    def _send(self, progress: CheckpointProgress, frames: list[Any]) -> bool:
        if progress.lost or progress.finished:
            return self._drop(progress)  # an earlier block of it was lost: a gap
        try:
            self._stream.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return self._drop(progress)
        progress.sent += 1
        self.counters.sent += 1
        return True

    def finish(self, ckpt_id: str, request_id: str, *, queued: bool = False) -> bool:
        """Tell the holder the request `request_id` ended (its pages are freed unless another
        request has resumed the checkpoint since); False when not sent.

        On the stream by default: after this streamer's pages, and dropped when no holder is
        connected. `queued`: on the call socket instead, which keeps it (up to its
        high-water mark) until the holder connects, for a caller that sends no pages and
        must not wait for a connection (vLLM's scheduler)."""
        progress = self.progress.pop(ckpt_id, None)
        if progress is not None:
            progress.finished = True
        frame = wire.encode_header(wire.request(wire.FINISH, ckpt_id=ckpt_id,
                                                request_id=request_id))
        if queued:
            self._collect_replies()  # the ACKs of earlier ones: nobody waits for them
        try:
            (self._rpc_socket() if queued else self._stream).send(frame, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def poll_acks(self) -> int:
        """Read every reply already here (no waiting); returns how many."""
        n = 0
        while True:
            try:
                parts = self._stream.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return n
            n += 1
            self._on_reply(parts)

    def _on_reply(self, parts: Sequence[Any]) -> None:
        try:
            h = wire.decode(parts).header
        except WireError as exc:
            self._count_error(exc.reason)
            return
        progress = self.progress.get(h.ckpt_id)
        if h.op == wire.ACK:
            self.counters.acks += 1
            if progress is not None:
                progress.reached = max(progress.reached, h.reached)
        elif h.op == wire.ERROR:
            self._count_error(h.reason)
            if progress is not None and not progress.refused:
                progress.refused = h.reason
                self.counters.refusals += 1

    def _count_error(self, reason: str) -> None:
        self.counters.errors[reason] = self.counters.errors.get(reason, 0) + 1

    def _drop(self, progress: CheckpointProgress) -> bool:
        progress.dropped += 1
        self.counters.dropped += 1
        return False

    def wait_acks(self, ckpt_id: str, timeout_s: float) -> CheckpointProgress:
        """Wait until every block sent for `ckpt_id` is ACKed or refused (benchmarks, tests)."""
        deadline = time.monotonic() + timeout_s
        progress = self.progress.setdefault(ckpt_id, CheckpointProgress())
        while progress.reached < progress.sent and not progress.refused:
            left = deadline - time.monotonic()
            if left <= 0 or not self._stream.poll(int(left * 1000) + 1, zmq.POLLIN):
                break
            self.poll_acks()
        return progress

    # -- resume side (waits, with a timeout) ----------------------------------------------

    def lookup(self, ckpt_id: str, hashes: Sequence[bytes | str], *,
               timeout_s: float = 1.0, request_id: str = "") -> int | None:
        """Consecutive blocks of `hashes` the holder has on every tp rank; None: no answer.
        With `request_id` the resuming request takes the checkpoint over (its FINISH, not
        the previous engine's, frees it)."""
        reply = self._call(self._lookup_header(ckpt_id, hashes, request_id), timeout_s)
        if reply is None or reply.header.op != wire.ACK:
            return None
        return reply.header.matched

    def _lookup_header(self, ckpt_id: str, hashes: Sequence[bytes | str],
                       request_id: str) -> Header:
        return wire.request(
            wire.LOOKUP, ckpt_id=ckpt_id, hashes=list(hashes), model=self.layout.model,
            layout_fingerprint=self.layout.layout_fingerprint, request_id=request_id)

    # -- calls answered later, for a caller that must not wait (vLLM's scheduler and worker) --

    def ask_lookup(self, ckpt_id: str, hashes: Sequence[bytes | str], *,
                   request_id: str = "") -> int | None:
        """Send a LOOKUP and return at once: the call's number for `lookup_answer`, or None
        when it could not even be queued."""
        return self.ask(self._lookup_header(ckpt_id, hashes, request_id))

    def lookup_answer(self, call: int, wait_s: float = 0.0) -> int | None:
        """The blocks matched for an `ask_lookup` call (0 when the holder refused it), or
        None while it is unanswered after waiting up to `wait_s`. An answer is handed out
        once; `forget` a call given up on."""
        deadline = time.monotonic() + wait_s
        while True:
            reply = self.answer(call)
            if reply is not None:
                return reply.header.matched if reply.header.op == wire.ACK else 0
            left = deadline - time.monotonic()
            if left <= 0 or not self.wait_replies(left):
                return None

    def ask_get(self, ckpt_id: str, block_hash: bytes | str, *,
                tp_rank: int | None = None) -> int | None:
        """Send a GET for one page (this rank's unless `tp_rank`) and return at once: the
        call's number for `answer`, or None when the send queue is full."""
        rank = self.layout.tp_rank if tp_rank is None else tp_rank
        return self.ask(wire.request(wire.GET, ckpt_id=ckpt_id, block_hash=block_hash,
                                     tp_rank=rank, tp_size=self.layout.tp_size))

    def ask(self, header: Header) -> int | None:
        """Send a call without waiting: its number, or None when it could not be queued."""
        rpc = self._rpc_socket()
        seq = next(self._seq)
        try:
            rpc.send(wire.encode_header(msgspec.structs.replace(header, seq=seq)),
                     flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        self._awaited[seq] = None
        return seq

    def answer(self, call: int) -> wire.Message | None:
        """The reply to an `ask` call if it came (handed out once), else None; never waits."""
        return self.answers((call,)).get(call)

    def answers(self, calls: Iterable[int]) -> dict[int, wire.Message]:
        """The replies that came to `calls` (each handed out once); never waits."""
        self._collect_replies()
        came: dict[int, wire.Message] = {}
        for call in calls:
            reply = self._awaited.get(call)
            if reply is not None:
                came[call] = reply
                del self._awaited[call]
        return came

    def reply_socket(self) -> zmq.Socket[Any]:
        """The socket the replies to `ask` calls come on (to wait on several streamers)."""
        return self._rpc_socket()

    def wait_replies(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a reply to arrive (True when one is here)."""
        return bool(self._rpc_socket().poll(max(0, int(timeout_s * 1000)) + 1, zmq.POLLIN))

    def forget(self, call: int) -> None:
        """Give up on an `ask` call: its reply, if it ever comes, is dropped."""
        self._awaited.pop(call, None)

    def _collect_replies(self) -> None:
        """Read every reply already here (no waiting), keeping those still awaited."""
        rpc = self._rpc_socket()
        while True:
            try:
                parts = rpc.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._keep_if_awaited(parts)

    def _keep_if_awaited(self, parts: Sequence[Any]) -> wire.Message | None:
        """Decode a reply; one to an `ask` call is kept for `answer`, and None returned.
        Replies to calls given up on are dropped (None too)."""
        try:
            message = wire.decode(parts)
        except WireError as exc:
            self._count_error(exc.reason)
            return None
        self.last_reply_at = time.monotonic()
        if message.header.seq in self._awaited:
            self._awaited[message.header.seq] = message
            return None
        return message

    def get(self, ckpt_id: str, block_hash: bytes | str, *, tp_rank: int | None = None,
            timeout_s: float = 1.0) -> FetchedPage | None:
        """One page (this rank's unless `tp_rank`); None when missing or no answer."""
        rank = self.layout.tp_rank if tp_rank is None else tp_rank
        reply = self._call(wire.request(
            wire.GET, ckpt_id=ckpt_id, block_hash=block_hash, tp_rank=rank,
            tp_size=self.layout.tp_size), timeout_s)
        if reply is None or reply.header.op != wire.ACK or reply.payload is None:
            return None
        return FetchedPage(reply.header, reply.payload)

    def get_many(self, ckpt_id: str, hashes: Sequence[bytes | str], *,
                 tp_rank: int | None = None, window: int = 16,
                 timeout_s: float = 1.0) -> list[FetchedPage]:
        """The pages of `hashes`, in order, up to the first one missing or unanswered, with
        up to `window` GETs in flight (one round trip per page would bound a resume by the
        latency, not the bandwidth). `timeout_s` bounds the wait for each next reply."""
        from lumend.checkpoint.fetch import PageFetch

        fetch = PageFetch(self, ckpt_id, hashes, tp_rank=tp_rank, window=window,
                          timeout_s=timeout_s)
        pages: dict[int, FetchedPage] = {}
        while True:
            pages.update(fetch.advance())
            if fetch.done:
                return [pages[i] for i in range(fetch.usable)]
            self.wait_replies(fetch.wait_s())

    def _rpc_socket(self) -> zmq.Socket[Any]:
        if self._rpc is None:
            self._rpc = self._socket(sndhwm=64, immediate=False)
        return self._rpc

    def _call(self, header: Header, timeout_s: float) -> wire.Message | None:
        self._rpc_socket()
        assert self._rpc is not None
        seq = next(self._seq)
        header = msgspec.structs.replace(header, seq=seq)
        deadline = time.monotonic() + timeout_s
        try:
            self._rpc.send(wire.encode_header(header), flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._rpc.poll(int(left * 1000) + 1, zmq.POLLIN):
                self.counters.timeouts += 1
                return None
            message = self._keep_if_awaited(self._rpc.recv_multipart(copy=False))
            if message is not None and message.header.seq == seq:
                return message  # (replies to earlier calls that timed out are skipped)

    def close(self) -> None:
        self._stream.close(0)
        if self._rpc is not None:
            self._rpc.close(0)
