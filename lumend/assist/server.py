"""The drafter's side of draft-assist: a ROUTER that keeps each request's committed context
and drafts k tokens per round with a pluggable draft function.

Per request it holds the committed context (append-only updates from the survivor) and its
speculative state (the context it last drafted from plus those drafts). On each round it
tells the draft function how much of that state is still valid: the longest common prefix
with the new committed context (rejected drafts fall out of it). When rounds queue up (the
draft function is slower than the survivor's steps), every queued update is applied but only
each survivor's newest round is drafted for; the others are dropped unanswered (the
survivor has moved past them). A request whose update does not reach its `base` is answered
with `resync` (the survivor then sends the whole context). Released requests are freed, and
so are contexts idle longer than the ttl or beyond the request cap (least recently used).

With the cluster's CURVE keys (lumend.checkpoint.security, the checkpoint key file) the
socket is a CURVE server and a ZAP handler admits only the cluster's client key. Refused
peers and malformed messages are counted by reason and logged (rate-limited); nothing a
peer sends stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
import zmq.asyncio

from lumend.assist import wire
from lumend.checkpoint.security import CurveKeys
from lumend.checkpoint.zap import (
    HANDSHAKE_FAILED,
    ZapBindError,
    bind_zap,
    serve_zap,
    watch_handshakes,
)

log = logging.getLogger("lumend.assist")

LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class DraftJob:
    """Draft for `request_id` after `context`; the function's own state for this request
    is valid for the first `reuse` tokens of it (0: start afresh)."""

    request_id: str
    context: Sequence[int]
    reuse: int


class DraftFunction(Protocol):
    """What drafts: a noisy copy of the sim target, or a small model for vLLM."""

    def draft(self, jobs: Sequence[DraftJob], k: int) -> list[list[int]]:
        """Up to k tokens per job, in job order. May block (it runs in a worker thread)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget any state kept for this request."""
        ...


@dataclass(frozen=True)
class DraftServerConfig:
    listen: str                   # "host:port" (port 0: any free port)
    model: str = ""               # refuse rounds for another model ("" accepts any)
    curve: CurveKeys | None = None  # None: no authentication, no encryption (tests only)
    max_requests: int = 4096      # contexts kept; beyond, the least recently used is dropped
    ttl_s: float = 600.0          # a context idle this long is dropped
    sweep_interval_s: float = 5.0
    rcvhwm: int = 1000


@dataclass
class _Context:
    committed: list[int]
    speculative: list[int] = field(default_factory=list)
    same: int = 0  # speculative[:same] == committed[:same], known without comparing
    used_at: float = 0.0

    def reusable(self) -> int:
        """The longest common prefix of the speculative state and the committed context
        (only the part past `same`, the drafts, is compared)."""
        return self.same + _common_prefix(self.speculative[self.same:],
                                          self.committed[self.same:])


@dataclass(frozen=True)
class DraftServerStats:
    rounds: int             # rounds received
    drafted_rounds: int     # rounds answered with drafts
    skipped_rounds: int     # rounds applied but superseded by a newer one before drafting
    drafted_tokens: int
    resyncs: int            # items answered with resync
    releases: int
    evicted: int            # contexts dropped for the cap or the ttl
    requests: int           # contexts held now
    refused: dict[str, int]  # by wire.Reason


class DraftBindError(Exception):
    """The listen address cannot be bound; the message names the problem and the fix."""


def zmq_endpoint(listen: str) -> tuple[str, bool]:
    """ "host:port" (or "[v6]:port") -> ("tcp://host:port", is_ipv6)."""
    host, port = listen.rsplit(":", 1)
    ipv6 = host.startswith("[") or ":" in host
    host = host.strip("[]") or "0.0.0.0"
    return (f"tcp://[{host}]:{port}" if ipv6 else f"tcp://{host}:{port}"), ipv6


class DraftServer:
    def __init__(self, config: DraftServerConfig, function: DraftFunction,
                 context: zmq.asyncio.Context | None = None,
                 clock: Any = time.monotonic) -> None:
        self.config = config
        self.function = function
        self._clock = clock
        # A ZAP handler serves its whole context: a secure server gets a context of its own.
        self._own_context = context is None and config.curve is not None
        self._context = context or (zmq.asyncio.Context() if self._own_context
                                    else zmq.asyncio.Context.instance())
        self._socket: zmq.asyncio.Socket | None = None
        self._zap: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self.contexts: OrderedDict[str, _Context] = OrderedDict()
        self.refused: Counter[str] = Counter({r: 0 for r in wire.REASONS})
        self.rounds = self.drafted_rounds = self.skipped_rounds = self.drafted_tokens = 0
        self.resyncs = self.releases = self.evicted = 0
        self._last_warning: dict[str, float] = {}
        self.endpoint = ""

    # -- lifecycle ------------------------------------------------------------------------

    def bind(self) -> None:
        endpoint, ipv6 = zmq_endpoint(self.config.listen)
        curve = self.config.curve
        if curve is not None:
            self._bind_zap()
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, int(ipv6))
        sock.setsockopt(zmq.RCVHWM, self.config.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        if curve is not None:
            curve.serve(sock)
            self._monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket = sock
            self.close()
            raise DraftBindError(f"draft server: cannot listen on {self.config.listen} "
                                 f"({exc}); choose a free port or an address of this host"
                                 ) from exc
        self._socket = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("draft server on %s (model %s), %s", self.endpoint, self.config.model or "any",
                 "CURVE (cluster keys)" if curve else "insecure")
        if curve is None:
            log.warning("draft server without CURVE keys: any peer that reaches %s can send "
                        "contexts and read drafts in clear; set [checkpoint] keys outside "
                        "tests", self.endpoint)

    def _bind_zap(self) -> None:
        try:
            self._zap = bind_zap(self._context)
        except ZapBindError as exc:
            raise DraftBindError(str(exc)) from exc

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then close the socket."""
        if self._socket is None:
            self.bind()
        tasks = [asyncio.create_task(self._serve(), name="draft-serve"),
                 asyncio.create_task(self._sweep(stop), name="draft-sweep")]
        if self._zap is not None:
            tasks.append(asyncio.create_task(
                serve_zap(self._zap, self._allowed_key(), self._unauthenticated),
                name="draft-zap"))
        if self._monitor is not None:
            tasks.append(asyncio.create_task(
                watch_handshakes(self._monitor, self._unauthenticated),
                name="draft-handshakes"))
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self.close()

    def close(self) -> None:
        if self._monitor is not None and self._socket is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
        for sock in (self._monitor, self._zap, self._socket):
            if sock is not None:
                sock.close(0)
        self._monitor = self._zap = self._socket = None
        if self._own_context:
            self._context.term()
            self._own_context = False

    def stats(self) -> DraftServerStats:
        return DraftServerStats(
            rounds=self.rounds, drafted_rounds=self.drafted_rounds,
            skipped_rounds=self.skipped_rounds, drafted_tokens=self.drafted_tokens,
            resyncs=self.resyncs, releases=self.releases, evicted=self.evicted,
            requests=len(self.contexts), refused=dict(self.refused))

    # -- serving --------------------------------------------------------------------------

    async def _serve(self) -> None:
        assert self._socket is not None
        sock = self._socket
        while True:
            batch = [await sock.recv_multipart(copy=False)]
            while len(batch) < 10_000:  # take whatever queued up while we drafted
                try:
                    batch.append(await sock.recv_multipart(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
            try:
                replies = await self.handle(batch)
            except Exception:  # a bug here must not take the server down with it
                log.exception("draft server: unexpected error handling %d messages", len(batch))
                continue
            for reply in replies:
                with contextlib.suppress(zmq.Again):
                    await sock.send_multipart(reply, flags=zmq.NOBLOCK, copy=False)

    async def handle(self, batch: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """Messages as received (identity first) -> reply frames (identity first)."""
        replies: list[list[Any]] = []
        newest: dict[bytes, tuple[wire.Round, list[str]]] = {}
        carried: dict[bytes, set[str]] = {}  # resyncs of rounds superseded before drafting
        for parts in batch:
            identity = bytes(parts[0])
            try:
                message = wire.decode_request(parts[1:])
                if isinstance(message, wire.Release):
                    self._release(message.request_ids)
                    continue
                resync = self._apply(message)
            except wire.WireError as exc:
                self._refuse(exc.reason, str(exc))
                replies.append([identity, wire.encode(wire.error(exc.seq, exc.reason,
                                                                 str(exc)))])
                continue
            previous = newest.get(identity)
            if previous is not None:
                self.skipped_rounds += 1
                carried.setdefault(identity, set()).update(previous[1])
            newest[identity] = (message, resync)
        for identity, (round_, resync) in newest.items():
            items = await self._draft(round_, set(resync))
            extra = carried.get(identity, set()) - {i.request_id for i in items}
            items += [wire.Draft(request_id=r, resync=True) for r in sorted(extra)]
            replies.append([identity, wire.encode(wire.drafts(round_.seq, items))])
        return replies

    def _apply(self, round_: wire.Round) -> list[str]:
        """Apply a round's context updates; returns the requests that need a resync."""
        if self.config.model and round_.model and round_.model != self.config.model:
            raise wire.WireError("model", f"model: round for {round_.model!r}, this drafter "
                                 f"drafts for {self.config.model!r}; check the assignment",
                                 round_.seq)
        for i, item in enumerate(round_.items):
            if item.base + len(item.tokens) > wire.MAX_TOKENS:
                raise wire.WireError("malformed", f"items[{i}]: base + tokens = "
                                     f"{item.base + len(item.tokens)} over the "
                                     f"{wire.MAX_TOKENS}-token limit", round_.seq)
        self.rounds += 1
        now = self._clock()
        resync = []
        for item in round_.items:
            ctx = self.contexts.get(item.request_id)
            if item.base == 0:
                if ctx is None:
                    ctx = self.contexts[item.request_id] = _Context(list(item.tokens))
                    self._cap()
                else:
                    ctx.committed = list(item.tokens)
                    ctx.same = 0
            elif ctx is None or item.base > len(ctx.committed):
                resync.append(item.request_id)
                continue
            else:
                del ctx.committed[item.base:]
                ctx.committed.extend(item.tokens)
                ctx.same = min(ctx.same, item.base)
            ctx.used_at = now
            self.contexts.move_to_end(item.request_id)
        self.resyncs += len(resync)
        return resync

    async def _draft(self, round_: wire.Round, resync: set[str]) -> list[wire.Draft]:
        jobs = []
        for item in round_.items:
            ctx = self.contexts.get(item.request_id)
            if item.request_id in resync or ctx is None:
                continue
            jobs.append(DraftJob(item.request_id, list(ctx.committed), ctx.reusable()))
        drafted: list[list[int]] = []
        if jobs and round_.k > 0:
            drafted = await asyncio.to_thread(self.function.draft, jobs, round_.k)
        items = [wire.Draft(request_id=r, resync=True) for r in sorted(resync)]
        for job, tokens in zip(jobs, drafted, strict=False):
            tokens = [t for t in tokens[:round_.k] if 0 <= t <= wire.MAX_TOKEN_ID]
            ctx = self.contexts.get(job.request_id)
            if ctx is not None:
                ctx.speculative = [*job.context, *tokens]
                ctx.same = len(job.context)
            self.drafted_tokens += len(tokens)
            items.append(wire.Draft(request_id=job.request_id, drafts=tokens))
        if drafted:
            self.drafted_rounds += 1
        return items

    def _release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            if self.contexts.pop(request_id, None) is not None:
                self.releases += 1
                self.function.release(request_id)

    def _cap(self) -> None:
        while len(self.contexts) > self.config.max_requests:
            request_id, _ = self.contexts.popitem(last=False)
            self.evicted += 1
            self.function.release(request_id)

    async def _sweep(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.config.sweep_interval_s)
            self.sweep()

    def sweep(self) -> int:
        """Drop contexts idle longer than the ttl (a survivor gone without releasing)."""
        limit = self._clock() - self.config.ttl_s
        idle = [r for r, c in self.contexts.items() if c.used_at < limit]
        for request_id in idle:
            del self.contexts[request_id]
            self.evicted += 1
            self.function.release(request_id)
        return len(idle)

    # -- authentication -------------------------------------------------------------------

    def _allowed_key(self) -> bytes:
        assert self.config.curve is not None
        return self.config.curve.client_public_raw

    def _unauthenticated(self, message: str) -> None:
        self._refuse("unauthenticated", message)

    def _refuse(self, reason: str, message: str) -> None:
        self.refused[reason] += 1
        now = time.monotonic()
        if now - self._last_warning.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_warning[reason] = now
            log.warning("draft server refused a message (%s): %s [%d so far]", reason,
                        message, self.refused[reason])


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
