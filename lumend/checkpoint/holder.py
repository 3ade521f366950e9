"""The checkpoint holder service: one per node, a ROUTER socket on `[checkpoint] listen`.

Engines stream KV pages here (PUT); resuming engines ask what is held (LOOKUP) and load it
(GET); a finished request frees its pages (FINISH). Every request gets one reply, an ACK or
an ERROR naming the reason. Bad input is refused, counted and logged (rate-limited); nothing
a peer sends can stop the service.

With CURVE keys (`security.py`) the socket is a CURVE server and a ZAP handler of our own
admits only peers presenting the cluster's client key; every refused handshake is counted
as `unauthenticated`, and the holder keeps serving the peers that pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from lumend.checkpoint import wire
from lumend.checkpoint.security import CurveKeys
from lumend.checkpoint.store import (
    CheckpointStore,
    PageMeta,
    Policy,
    StoreRefusal,
    WorkerStats,
)
from lumend.checkpoint.wire import Header, Reason, WireError
from lumend.checkpoint.zap import (
    HANDSHAKE_FAILED,
    ZapBindError,
    bind_zap,
    serve_zap,
    watch_handshakes,
)

log = logging.getLogger("lumend.checkpoint")

LOG_EVERY_S = 10.0  # at most one warning per reason per interval; the counters count all
# Handshakes that fail before ZAP is asked: a peer without CURVE, or with another server key.
# (A key refused by ZAP is counted by the ZAP handler, which also knows the key.)


@dataclass(frozen=True)
class HolderConfig:
    listen: str
    workers: tuple[str, ...]
    budget_bytes: int
    policy: Policy = "lru"
    ttl_s: float = 600.0
    max_page_bytes: int = wire.DEFAULT_MAX_PAGE_BYTES
    sweep_interval_s: float = 5.0
    rcvhwm: int = 1000
    # What one peer may have queued here before the budget sees it, in bytes: the socket's
    # high-water mark (messages, per peer) is set so that its largest messages fit in it.
    # Beyond it the peer's own queue fills, in the peer's memory, and its sends fail there.
    queue_bytes: int = 1 << 30
    curve: CurveKeys | None = None  # None: no authentication, no encryption (tests only)


@dataclass(frozen=True)
class HolderStats:
    """A snapshot for etcd heartbeats and Prometheus."""

    workers: dict[str, WorkerStats]
    bad_frames: dict[str, int]
    lookups: int
    gets: int


class HolderBindError(Exception):
    """The listen address cannot be bound; the message names the key and the fix."""


def zmq_endpoint(listen: str) -> tuple[str, bool]:
    """ "host:port" (or "[v6]:port") -> ("tcp://host:port", is_ipv6)."""
    host, port = listen.rsplit(":", 1)
    ipv6 = host.startswith("[") or ":" in host
    host = host.strip("[]") or "0.0.0.0"
    return (f"tcp://[{host}]:{port}" if ipv6 else f"tcp://{host}:{port}"), ipv6


class HolderService:
    def __init__(self, config: HolderConfig, context: zmq.asyncio.Context | None = None,
                 store: CheckpointStore | None = None) -> None:
        self.config = config
        self.store = store or CheckpointStore(config.workers, config.budget_bytes,
                                              config.policy, config.ttl_s)
        # A ZAP handler serves its whole context, so a secure holder gets a context of its
        # own (several holders in one process, as in tests, must not share one).
        self._own_context = context is None and config.curve is not None
        self._context = context or (zmq.asyncio.Context() if self._own_context
                                    else zmq.asyncio.Context.instance())
        self._socket: zmq.asyncio.Socket | None = None
        self._zap: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self.bad_frames: Counter[str] = Counter({r: 0 for r in wire.BAD_FRAME_REASONS})
        self.lookups = 0
        self.gets = 0
        self.finishes_ignored = 0
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
        sock.setsockopt(zmq.RCVHWM, self.queue_messages())
        # libzmq drops (and disconnects) a peer whose message is far beyond any page, before
        # buffering it; pages merely over the limit arrive and are refused and counted here.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes())
        if curve is not None:
            curve.serve(sock)
            self._monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket = sock
            self.close()
            raise HolderBindError(
                f'checkpoint.listen = "{self.config.listen}": cannot listen there ({exc}); '
                "choose a free port or an address of this host"
            ) from exc
        self._socket = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("checkpoint holder on %s: %d workers, budget %d bytes each, eviction %s, %s",
                 self.endpoint, len(self.config.workers), self.config.budget_bytes,
                 self.config.policy, "CURVE (cluster keys)" if curve else "insecure")
        if curve is None:
            log.warning("checkpoint holder without CURVE keys: any peer that reaches %s can "
                        "store and read KV pages, which travel in clear; set [checkpoint] "
                        "keys outside tests", self.endpoint)

    def max_message_bytes(self) -> int:
        return 2 * self.config.max_page_bytes + wire.MAX_HEADER_BYTES

    def queue_messages(self) -> int:
        """The receive high-water mark: as many of the largest messages as fit in
        `queue_bytes`, at least 4 (and at most `rcvhwm`)."""
        fit = self.config.queue_bytes // self.max_message_bytes()
        return max(4, min(self.config.rcvhwm, fit))

    def _bind_zap(self) -> None:
        try:
            self._zap = bind_zap(self._context)
        except ZapBindError as exc:
            raise HolderBindError(str(exc)) from exc

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then close the socket (pages are dropped with it)."""
        if self._socket is None:
            self.bind()
        tasks = [asyncio.create_task(self._sweep(stop), name="checkpoint-orphans"),
                 asyncio.create_task(self._serve(), name="checkpoint-serve")]
        if self._zap is not None:
            tasks.append(asyncio.create_task(
                serve_zap(self._zap, self._allowed_key(), self._unauthenticated),
                name="checkpoint-zap"))
        if self._monitor is not None:
            tasks.append(asyncio.create_task(
                watch_handshakes(self._monitor, self._unauthenticated),
                name="checkpoint-handshakes"))
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
        for sock in (self._monitor, self._zap):
            if sock is not None:
                sock.close(0)
        self._monitor = self._zap = None
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None
            held = sum(s.bytes_held for s in self.store.stats.values())
            log.info("checkpoint holder stopped; %d bytes of checkpoints dropped", held)
        if self._own_context:
            self._context.term()
            self._own_context = False

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> HolderStats:
        return HolderStats(
            workers={w: dataclasses.replace(s) for w, s in self.store.stats.items()},
            bad_frames=dict(self.bad_frames), lookups=self.lookups, gets=self.gets,
        )

    # -- serving --------------------------------------------------------------------------

    async def _serve(self) -> None:
        assert self._socket is not None
        sock = self._socket
        while True:
            parts = await sock.recv_multipart(copy=False)
            try:
                if _lookup_size(parts) > LOOKUP_INLINE_HASHES:
                    # A long prompt's lookup (hashes x tp ranks) runs beside the event loop,
                    # which renews lumend's etcd lease; nothing else is handled meanwhile.
                    reply = await asyncio.to_thread(self.handle, parts[1:])
                else:
                    reply = self.handle(parts[1:])
            except Exception:  # a bug here must not take the holder down with it
                log.exception("checkpoint holder: unexpected error handling a message")
                reply = [wire.encode_header(wire.error_reply(0, "malformed", "internal error"))]
            with contextlib.suppress(zmq.Again):
                await sock.send_multipart([parts[0], *reply], flags=zmq.NOBLOCK, copy=False)
            # A receive with messages queued completes without giving the loop a turn: under
            # a flood of pages the lease keepalive and heartbeats would wait for the flood.
            await asyncio.sleep(0)

    def _allowed_key(self) -> bytes:
        assert self.config.curve is not None
        return self.config.curve.client_public_raw

    def _unauthenticated(self, message: str) -> None:
        self._bad("unauthenticated", message)

    async def _sweep(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.config.sweep_interval_s)
            orphans = self.store.collect_orphans()
            if orphans:
                log.info("checkpoint holder: collected %d orphaned checkpoints (no activity "
                         "for %g s): %s", len(orphans), self.config.ttl_s,
                         ", ".join(orphans[:5]) + (" ..." if len(orphans) > 5 else ""))

    def handle(self, parts: Sequence[Any]) -> list[Any]:
        """One request (frames after the ROUTER identity) -> the reply's frames."""
        try:
            message = wire.decode(parts, self.config.max_page_bytes)
        except WireError as exc:
            self._bad(exc.reason, str(exc))
            return [wire.encode_header(wire.error_reply(_seq_of(parts), exc.reason, str(exc)))]
        h = message.header
        try:
            return self._dispatch(h, message.payload, parts)
        except WireError as exc:
            self._bad(exc.reason, str(exc))
            return [wire.encode_header(self._error(h, exc.reason, str(exc)))]
        except StoreRefusal as exc:
            if exc.reason in wire.BAD_FRAME_REASONS:
                self._bad(exc.reason, str(exc))
            return [wire.encode_header(self._error(h, exc.reason, str(exc)))]

    def _dispatch(self, h: Header, payload: memoryview | None,
                  parts: Sequence[Any]) -> list[Any]:
        store = self.store
        if h.op == wire.PUT:
            assert payload is not None
            result = store.put(
                ckpt_id=h.ckpt_id, request_id=h.request_id, worker=h.worker, model=h.model,
                fingerprint=h.layout_fingerprint, tp_rank=h.tp_rank, tp_size=h.tp_size,
                block_hash=wire.hash_bytes(h.block_hash),
                meta=PageMeta(h.block_index, h.token_count, h.dtype, tuple(h.page_shape)),
                data=parts[1], nbytes=payload.nbytes,
            )
            if result.evicted:
                log.info("checkpoint holder: worker %s full, evicted %s (%s) for %s",
                         h.worker, ", ".join(result.evicted), store.policy, h.ckpt_id)
            return [wire.encode_header(wire.request(
                wire.ACK, seq=h.seq, ckpt_id=h.ckpt_id, tp_rank=h.tp_rank, tp_size=h.tp_size,
                block_index=h.block_index, reached=result.reached))]
        if h.op == wire.LOOKUP:
            self.lookups += 1
            hashes = [wire.hash_bytes(x, f"hashes[{i}]") for i, x in enumerate(h.hashes)]
            matched = store.lookup(h.ckpt_id, hashes, model=h.model,
                                   fingerprint=h.layout_fingerprint, request_id=h.request_id)
            return [wire.encode_header(wire.request(wire.ACK, seq=h.seq, ckpt_id=h.ckpt_id,
                                                    matched=matched))]
        if h.op == wire.GET:
            self.gets += 1
            page = store.get(h.ckpt_id, wire.hash_bytes(h.block_hash), h.tp_rank)
            if page is None:
                return [wire.encode_header(self._error(h, "missing", f"checkpoint {h.ckpt_id}"
                                                       f" has no such page on rank {h.tp_rank}"))]
            m = page.meta
            reply = wire.request(wire.ACK, seq=h.seq, ckpt_id=h.ckpt_id, tp_rank=h.tp_rank,
                                 tp_size=h.tp_size, block_index=m.block_index,
                                 block_hash=h.block_hash, token_count=m.token_count,
                                 dtype=m.dtype, page_shape=list(m.page_shape))
            return [wire.encode_header(reply), page.data]
        if h.op == wire.FINISH:
            if not h.request_id:
                raise WireError("malformed", "request_id: a FINISH must name the engine "
                                "request that ended (without one it would free a checkpoint "
                                "another engine resumed from)")
            if store.finish(h.ckpt_id, h.request_id) is None:
                self.finishes_ignored += 1  # from an engine the request has moved away from
            return [wire.encode_header(wire.request(wire.ACK, seq=h.seq, ckpt_id=h.ckpt_id))]
        raise WireError("malformed", f"op: {h.op} is a reply, not a request")

    @staticmethod
    def _error(h: Header, reason: Reason, message: str) -> Header:
        return wire.error_reply(h.seq, reason, message, ckpt_id=h.ckpt_id, tp_rank=h.tp_rank,
                                tp_size=h.tp_size, block_index=h.block_index)

    def _bad(self, reason: Reason, message: str) -> None:
        self.bad_frames[reason] += 1
        now = time.monotonic()
        if now - self._last_warning.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_warning[reason] = now
            log.warning("checkpoint holder refused a message (%s): %s [%d so far]",
                        reason, message, self.bad_frames[reason])


LOOKUP_INLINE_HASHES = 512  # larger lookups run in a thread


def _lookup_size(parts: Sequence[Any]) -> int:
    """A rough size of a message's work: its header's bytes / 32 for a LOOKUP (one hash per
    32 bytes), else 0. Read before decoding, so it never raises."""
    if len(parts) != 2:
        return 0
    header = memoryview(parts[1])
    return header.nbytes // 32 if b"lookup" in header[:256].tobytes() else 0


def _seq_of(parts: Sequence[Any]) -> int:
    """The seq of a header that failed validation, when it can still be read (else 0)."""
    if not parts or memoryview(parts[0]).nbytes > wire.MAX_HEADER_BYTES:
        return 0
    try:
        value = msgspec.msgpack.decode(memoryview(parts[0]))
    except Exception:
        return 0
    seq = value.get("seq", 0) if isinstance(value, dict) else 0
    return seq if isinstance(seq, int) and seq >= 0 else 0
