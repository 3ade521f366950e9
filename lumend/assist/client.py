"""The survivor's side of draft-assist: one round per decode step, drafts within a deadline.

`DraftSession` is the bookkeeping, free of I/O: how much of each request's committed context
the drafter has been sent (so a round carries only the new tokens), the round sequence, and
resync requests. Two transports share it: `DraftClient` (blocking, for vLLM's synchronous
`propose()`) and `AsyncDraftClient` (asyncio, for the sim engine). Both send a round, wait
until the deadline at most, drop replies to earlier rounds, and return {} when the drafter
is late, unreachable or refuses: a step never waits longer than the deadline.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from lumend.assist import wire
from lumend.checkpoint.security import CurveKeys

log = logging.getLogger("lumend.assist")

DEFAULT_SNDHWM = 64  # rounds queued for a drafter that does not read: then rounds are skipped
LOG_EVERY_S = 10.0


@dataclass
class ClientCounters:
    rounds: int = 0        # rounds sent
    on_time: int = 0       # rounds answered before the deadline
    late: int = 0          # rounds with no answer by the deadline (no drafts used)
    stale: int = 0         # replies to earlier rounds, dropped
    unsent: int = 0        # rounds the socket would not take (drafter gone or not reading)
    refused: int = 0       # Error replies (the drafter refused a round)
    bad_replies: int = 0   # replies that did not decode
    resyncs: int = 0       # requests whose whole context was asked for again
    releases: int = 0      # requests released


class DraftSession:
    """What the drafter has of each request's committed context, and the round numbers."""

    def __init__(self, model: str = "", survivor: str = "") -> None:
        self.model = model
        self.survivor = survivor
        self.seq = 0
        self.sent: dict[str, int] = {}      # request -> committed tokens the drafter has
        self._full_at: dict[str, int] = {}  # request -> seq of its last whole-context send
        self.counters = ClientCounters()

    def build(self, contexts: Mapping[str, Sequence[int]], k: int) -> wire.Round:
        """The next round: for each request only the tokens the drafter lacks."""
        self.seq += 1
        items = []
        for request_id, context in contexts.items():
            base = self.sent.get(request_id, 0)
            if base > len(context):  # the survivor's context shrank (preempted): start over
                base = 0
            if base == 0:
                self._full_at[request_id] = self.seq
            items.append(wire.Update(request_id=request_id, base=base,
                                     tokens=list(context[base:])))
        return wire.round_(self.seq, k, items, model=self.model, survivor=self.survivor)

    def sent_ok(self, round_: wire.Round) -> None:
        for item in round_.items:
            self.sent[item.request_id] = item.base + len(item.tokens)

    def unsent(self, round_: wire.Round) -> None:
        """The round never left: the drafter has what it had before."""
        self.counters.unsent += 1
        for item in round_.items:
            if item.base == 0 and self._full_at.get(item.request_id) == round_.seq:
                self._full_at.pop(item.request_id, None)

    def absorb(self, reply: wire.Drafts) -> None:
        """Apply the resync requests of any reply, current or stale: a request the drafter
        lost is sent whole next round, unless a whole send went out after that reply's round
        (the drafter answers it from then on)."""
        for item in reply.items:
            if (item.resync and item.request_id in self.sent
                    and self._full_at.get(item.request_id, 0) <= reply.seq):
                self.counters.resyncs += 1
                self.sent[item.request_id] = 0

    def drafts_of(self, round_: wire.Round, reply: wire.Drafts) -> dict[str, list[int]]:
        wanted = {item.request_id for item in round_.items}
        return {d.request_id: list(d.drafts[:round_.k]) for d in reply.items
                if d.request_id in wanted and d.drafts and not d.resync}

    def release(self, request_ids: Iterable[str]) -> wire.Release | None:
        known = [r for r in request_ids if self.sent.pop(r, None) is not None]
        for r in known:
            self._full_at.pop(r, None)
        if not known:
            return None
        self.counters.releases += len(known)
        return wire.release(known)

    def release_absent(self, active: Iterable[str]) -> wire.Release | None:
        """Release every request the drafter has that is not in `active` (for a proposer
        that sees the running batch but not when a request finishes)."""
        keep = set(active)
        return self.release([r for r in self.sent if r not in keep])


def _socket(context: Any, endpoint: str, curve: CurveKeys | None) -> Any:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, DEFAULT_SNDHWM)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a drafter not (yet) connected
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
    if ":" in endpoint.rsplit("//", 1)[-1].split("]")[0]:
        sock.setsockopt(zmq.IPV6, 1)
    if curve is not None:
        curve.connect_as_client(sock)
    sock.connect(endpoint)
    return sock


class _Base:
    def __init__(self, endpoint: str, *, deadline_s: float, curve: CurveKeys | None,
                 model: str, survivor: str) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.endpoint = endpoint
        self.deadline_s = deadline_s
        self.session = DraftSession(model, survivor)
        self._last_warning: dict[str, float] = {}

    @property
    def counters(self) -> ClientCounters:
        return self.session.counters

    def _reply(self, parts: Sequence[Any], round_: wire.Round) -> dict[str, list[int]] | None:
        """A received message -> the drafts when it answers `round_`, else None (keep
        waiting)."""
        c = self.session.counters
        try:
            reply = wire.decode_reply(parts)
        except wire.WireError as exc:
            c.bad_replies += 1
            self._warn("bad_reply", f"drafter {self.endpoint} sent a reply that does not "
                       f"decode: {exc}")
            return None
        if isinstance(reply, wire.Error):
            if reply.seq != round_.seq:
                c.stale += 1
                return None
            c.refused += 1
            self._warn("refused", f"drafter {self.endpoint} refused round {reply.seq} "
                       f"({reply.reason}): {reply.error}")
            return {}
        self.session.absorb(reply)
        if reply.seq != round_.seq:
            c.stale += 1
            return None
        c.on_time += 1
        return self.session.drafts_of(round_, reply)

    def _warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_warning[kind] = now
            log.warning("%s", message)


class DraftClient(_Base):
    """Blocking client: `propose()` returns within `deadline_s`."""

    def __init__(self, endpoint: str, *, deadline_s: float, curve: CurveKeys | None = None,
                 model: str = "", survivor: str = "", context: zmq.Context[Any] | None = None,
                 ) -> None:
        super().__init__(endpoint, deadline_s=deadline_s, curve=curve, model=model,
                         survivor=survivor)
        self._sock: zmq.Socket[Any] = _socket(context or zmq.Context.instance(), endpoint,
                                              curve)

    def wait_connected(self, timeout_s: float) -> bool:
        """Whether the drafter is connected (rounds are not queued for a drafter that is
        not: they count as unsent)."""
        return bool(self._sock.poll(int(timeout_s * 1000), zmq.POLLOUT))

    def propose(self, contexts: Mapping[str, Sequence[int]], k: int) -> dict[str, list[int]]:
        """Drafts (up to k per request) for the requests' committed contexts; {} when late."""
        end = time.monotonic() + self.deadline_s
        self._drain()
        round_ = self.session.build(contexts, k)
        try:
            self._sock.send(wire.encode(round_), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.session.unsent(round_)
            return {}
        self.session.sent_ok(round_)
        self.counters.rounds += 1
        while (left := end - time.monotonic()) > 0:
            if not self._sock.poll(int(left * 1000), zmq.POLLIN):
                continue
            result = self._reply(self._sock.recv_multipart(copy=False), round_)
            if result is not None:
                return result
        self.counters.late += 1
        return {}

    def release(self, request_ids: Iterable[str]) -> None:
        self._send_release(self.session.release(request_ids))

    def release_absent(self, active: Iterable[str]) -> None:
        self._send_release(self.session.release_absent(active))

    def _send_release(self, message: wire.Release | None) -> None:
        if message is not None:
            with contextlib.suppress(zmq.Again):  # the drafter frees idle contexts (ttl)
                self._sock.send(wire.encode(message), zmq.NOBLOCK)

    def _drain(self) -> None:
        """Read replies that arrived after their deadline (resyncs are still applied)."""
        while True:
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._reply(parts, _NO_ROUND)

    def close(self) -> None:
        self._sock.close(0)


class AsyncDraftClient(_Base):
    """asyncio client: `propose()` returns within `deadline_s`, never blocking the loop."""

    def __init__(self, endpoint: str, *, deadline_s: float, curve: CurveKeys | None = None,
                 model: str = "", survivor: str = "",
                 context: zmq.asyncio.Context | None = None) -> None:
        super().__init__(endpoint, deadline_s=deadline_s, curve=curve, model=model,
                         survivor=survivor)
        self._sock: zmq.asyncio.Socket = _socket(context or zmq.asyncio.Context.instance(),
                                                 endpoint, curve)

    async def wait_connected(self, timeout_s: float) -> bool:
        # pyzmq's stub lacks the flags argument its asyncio poll takes
        return bool(await self._sock.poll(int(timeout_s * 1000), zmq.POLLOUT))  # type: ignore[call-arg]

    async def propose(self, contexts: Mapping[str, Sequence[int]],
                      k: int) -> dict[str, list[int]]:
        end = time.monotonic() + self.deadline_s
        await self._drain()
        round_ = self.session.build(contexts, k)
        try:
            await self._sock.send(wire.encode(round_), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.session.unsent(round_)
            return {}
        self.session.sent_ok(round_)
        self.counters.rounds += 1
        while (left := end - time.monotonic()) > 0:
            if not await self._sock.poll(int(left * 1000)):
                continue
            parts = await self._sock.recv_multipart(copy=False)
            result = self._reply(parts, round_)
            if result is not None:
                return result
        self.counters.late += 1
        return {}

    async def release(self, request_ids: Iterable[str]) -> None:
        await self._send_release(self.session.release(request_ids))

    async def release_absent(self, active: Iterable[str]) -> None:
        await self._send_release(self.session.release_absent(active))

    async def _send_release(self, message: wire.Release | None) -> None:
        if message is not None:
            with contextlib.suppress(zmq.Again):  # the drafter frees idle contexts (ttl)
                await self._sock.send(wire.encode(message), zmq.NOBLOCK)

    async def _drain(self) -> None:
        while True:
            try:
                parts = await self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._reply(parts, _NO_ROUND)

    def close(self) -> None:
        self._sock.close(0)


_NO_ROUND = wire.round_(0, 0, [])  # what a drained reply is matched against: nothing
