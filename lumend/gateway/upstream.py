"""Talking to engines: one streamed completion from a worker, read in the background (so a
migration can open its continuation before closing it), as pieces carrying token ids."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from lumend.gateway.quiet import QuietWatch

log = logging.getLogger("lumend.gateway")


class EngineRefused(Exception):
    """Every engine of the worker refused or could not be reached before a token came."""


class StreamBroken(Exception):
    """The upstream stream ended early: connection lost, engine gone, or no token in time."""


class EngineError(Exception):
    """The engine answered the request with a client error (4xx): the request itself is at
    fault (too long for the model's context, a bad parameter), so no other engine would do
    better. Carries the engine's status and its OpenAI error body for the client."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else body.get("message")
        super().__init__(str(message or body))
        self.status, self.body = status, body


class Piece(msgspec.Struct, frozen=True):
    """One chunk of an engine's stream, for the request's only choice (a Struct: one is
    made per streamed chunk, faster than a frozen dataclass)."""

    text: str
    finish_reason: str | None
    token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] | None = None  # on the first chunk only
    stop_reason: str | int | None = None
    logprobs: dict[str, Any] | None = None  # the engine's, in its endpoint's format


@dataclass
class PoolCounters:
    """Requests that waited for a connection to an engine because the pool was full, and
    those whose wait ran out (`pool_wait_s`: they fail like an unreachable engine)."""

    waits: int = 0
    timeouts: int = 0


KEEPALIVE_S = 4.0  # idle engine connections kept this long (under uvicorn's 5 s, vLLM's)
SIDE_REQUESTS = 1  # per stream: /detokenize, /v1/models or /lumen/engine while it resumes


def pool_size(max_streams: int) -> int:
    """Connections to engines the gateway keeps at most: one per stream (`max_streams`, the
    limit past which requests get 503) and one per stream for its side requests."""
    return max_streams * (1 + SIDE_REQUESTS)


def engine_session(max_streams: int, pool_wait_s: float, counters: PoolCounters,
                   connect_s: float = 2.0) -> aiohttp.ClientSession:
    """The one session the gateway talks to engines through, built once: a pool of
    `pool_size(max_streams)` connections kept alive between requests, no cookie jar, no
    User-Agent, no timeout object per request. Reads are timed per stream (first token, then
    gaps: `ReadTimeouts`), so the session has no read timeout; a request that finds the pool
    full waits at most `pool_wait_s` (counted in `counters`, and logged when it runs out)."""
    trace = aiohttp.TraceConfig()

    async def queued(_: object, ctx: Any, __: object) -> None:
        counters.waits += 1
        ctx.queued_at = time.monotonic()

    async def dequeued(_: object, ctx: Any, __: object) -> None:
        ctx.queued_at = None

    async def failed(_: object, ctx: Any, params: Any) -> None:
        if getattr(ctx, "queued_at", None) is None:
            return
        counters.timeouts += 1
        log.warning("no free connection to %s within %.1f s: the gateway's %d engine "
                    "connections (2 x [gateway] max_streams) are all in use",
                    params.url.origin(), time.monotonic() - ctx.queued_at,
                    pool_size(max_streams))

    trace.on_connection_queued_start.append(queued)
    trace.on_connection_queued_end.append(dequeued)
    trace.on_request_exception.append(failed)
    trace.freeze()
    connector = aiohttp.TCPConnector(limit=pool_size(max_streams), limit_per_host=0,
                                     keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent",), trace_configs=[trace],
        timeout=aiohttp.ClientTimeout(total=None, connect=pool_wait_s,
                                      sock_connect=connect_s, sock_read=None))


_JSON = {"Content-Type": "application/json"}
_encode_body = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class ReadTimeouts:
    first_token_s: float = 300.0  # queueing and a long prefill are not failures
    inactivity_s: float = 30.0  # a gap between tokens this long is


def parse_chunk(chunk: dict[str, Any]) -> Piece | None:
    """A streamed completion or chat chunk as a Piece; None for a chunk without a choice
    (a usage block)."""
    prompt = chunk.get("prompt_token_ids")  # chat: on the first chunk, at the top
    choices = chunk.get("choices") or []
    if not choices:
        return None if prompt is None else Piece("", None, (), tuple(prompt))
    choice = choices[0]
    delta = choice.get("delta") or {}
    text = choice.get("text") if "text" in choice else delta.get("content")
    prompt = choice.get("prompt_token_ids", prompt)
    return Piece(text or "", choice.get("finish_reason"), tuple(choice.get("token_ids") or ()),
                 None if prompt is None else tuple(prompt), choice.get("stop_reason"),
                 choice.get("logprobs"))


_decode = msgspec.json.Decoder().decode


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | msgspec.UnsetType | None = msgspec.UNSET
    delta: _Delta | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType | None = msgspec.UNSET
    stop_reason: str | int | None = None
    logprobs: dict[str, Any] | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    prompt_token_ids: list[int] | None = None
    error: Any = msgspec.UNSET


_decode_typed = msgspec.json.Decoder(_Chunk).decode


def _piece_of(data: bytes) -> Piece | None:
    """One SSE `data:` payload as a Piece (None for one without a choice); raises
    StreamBroken for an error event. The chunks engines send decode straight into typed
    structs (`parse_chunk`'s rules, a third of its cost per chunk); anything else (an error
    event, a field of another type) takes the general path."""
    try:
        typed = _decode_typed(data)
    except msgspec.DecodeError:
        pass
    else:
        if typed.error is msgspec.UNSET:
            prompt = typed.prompt_token_ids
            if not typed.choices:
                return None if prompt is None else Piece("", None, (), tuple(prompt))
            choice = typed.choices[0]
            if not isinstance(choice.text, msgspec.UnsetType):
                text = choice.text
            else:
                text = None if choice.delta is None else choice.delta.content
            if not isinstance(choice.prompt_token_ids, msgspec.UnsetType):
                prompt = choice.prompt_token_ids
            return Piece(text or "", choice.finish_reason, tuple(choice.token_ids or ()),
                         None if prompt is None else tuple(prompt), choice.stop_reason,
                         choice.logprobs)
    return _piece_of_json(data)


def _piece_of_json(data: bytes) -> Piece | None:
    try:
        chunk = _decode(data)
    except msgspec.DecodeError as exc:
        raise StreamBroken(f"the engine sent a chunk that is not JSON: {exc}") from None
    if not isinstance(chunk, dict):
        raise StreamBroken(f"the engine sent a chunk that is not an object: {data[:80]!r}")
    if "error" in chunk and not chunk.get("choices"):
        error = chunk["error"] if isinstance(chunk["error"], dict) else {}
        raise StreamBroken(f"the engine reported an error mid-stream: "
                           f"{error.get('message', chunk['error'])}")
    return parse_chunk(chunk)


# Responses read to [DONE] whose end (the chunked body's last, empty chunk) is still on its
# way: read in the background, so that their connections go back to the pool.
_ending: set[asyncio.Task[None]] = set()
END_WAIT_S = 5.0  # the end of a finished stream not read within this: connection closed


def _reuse(response: aiohttp.ClientResponse) -> None:
    """Give a response read to [DONE] back to the pool. The engine ends its body right after
    [DONE], usually in a packet of its own: released before that end is read, the connection
    would be closed and the next request would pay for a new one (a TCP handshake and
    aiohttp's connection setup: most of the gateway's cost per request). The end is read in
    the background, so the client's stream ends without waiting for it."""
    if response.content.is_eof():
        response.release()
        return
    task = asyncio.get_running_loop().create_task(_read_end(response))
    _ending.add(task)
    task.add_done_callback(_ending.discard)


async def _read_end(response: aiohttp.ClientResponse) -> None:
    try:
        async with asyncio.timeout(END_WAIT_S):
            while await response.content.readany():
                pass
    except (TimeoutError, aiohttp.ClientError):
        response.close()
        return
    except BaseException:  # cancelled (the loop is closing): the connection goes too
        response.close()
        raise
    response.release()


async def ends_read() -> None:
    """Wait until the ends of finished streams read in the background are read (tests)."""
    while _ending:
        await asyncio.wait(set(_ending))


async def stream_from(session: aiohttp.ClientSession, urls: tuple[str, ...], path: str,
                      body: dict[str, Any], timeouts: ReadTimeouts | None = None
                      ) -> AsyncGenerator[list[Piece], None]:
    """Pieces of one streamed completion from the first engine that accepts it, in batches:
    all the pieces that arrived in one read (a busy engine's chunks come several at a time,
    and handing them on together saves the gateway a wake-up per chunk).

    Raises `EngineRefused` if none accepts, `EngineError` for a 4xx, `StreamBroken` if the
    accepted stream ends before `[DONE]` or goes quiet (`timeouts`)."""
    timeouts = timeouts or ReadTimeouts()
    encoded = _encode_body(body)  # once, for all the urls tried
    response = None
    refusals: list[str] = []  # why each engine did not take it, for the log
    for url in urls:
        try:
            response = await session.post(url + path, data=encoded, headers=_JSON)
        except (aiohttp.ClientError, TimeoutError) as exc:
            refusals.append(f"{url}: {type(exc).__name__}")
            continue
        if response.status == 200:
            break
        if 400 <= response.status < 500 and response.status not in (404, 408, 429):
            try:
                detail = await response.json(content_type=None)
            except (ValueError, aiohttp.ClientError):
                detail = {"error": {"message": await response.text(), "type":
                                    "BadRequestError", "code": response.status}}
            response.release()
            raise EngineError(response.status,
                              detail if isinstance(detail, dict) else {"error": detail})
        # 503 from a standby, or an engine in trouble: try the next. A 404 names a model the
        # engine does not serve (the worker's record and its engines disagree): said here,
        # so the log shows why every request to the worker goes elsewhere.
        refusals.append(f"{url}: {response.status}" + (
            f" {(await response.text())[:200]}" if response.status == 404 else ""))
        response.release()
        response = None
    if response is None:
        raise EngineRefused(f"no engine accepted the request ({'; '.join(refusals)})")
    done = finished = False
    tokens = 0
    partial = b""

    def limit() -> float:
        return (END_WAIT_S if finished else timeouts.first_token_s if not tokens
                else timeouts.inactivity_s)

    watch = QuietWatch(limit)
    try:
        content = response.content
        while True:
            data = content.read_nowait()
            if not data:
                try:
                    data = await content.readany()
                except asyncio.CancelledError:
                    if not watch.expired():
                        raise
                    raise StreamBroken(f"no token for {limit():g} s ("
                                       f"{'before the first' if not tokens else 'after'} "
                                       f"{tokens} tokens)") from None
            if not data:
                break
            lines = (partial + data).split(b"\n")
            partial = lines.pop()  # what follows the last newline: a line still arriving
            batch: list[Piece] = []
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                try:
                    piece = _piece_of(payload)
                except StreamBroken:
                    if batch:  # what came before the bad chunk is the client's
                        yield batch
                    raise
                if piece is not None:
                    tokens += len(piece.token_ids) or bool(piece.text)
                    finished = finished or piece.finish_reason is not None
                    batch.append(piece)
            watch.heard()  # after counting: the limit it reads may have changed
            if batch:
                yield batch
            if done:
                return
        raise StreamBroken("the engine closed the stream before [DONE]")
    except aiohttp.ClientError as exc:
        raise StreamBroken(f"{type(exc).__name__}: {exc}") from exc
    finally:
        watch.close()
        if done:
            _reuse(response)
        else:
            # Not read to the end (the client left, or the stream broke): close the
            # connection, so the engine sees it and stops generating for nobody.
            response.close()


class MigrateAway(Exception):
    """The gateway is moving this request off its worker (a drain with --migrate). The
    upstream stays open: if the move does not happen, reading it goes on."""


_END = object()
_MIGRATE = object()


class Upstream:
    """One streamed completion, read in the background into a buffer.

    Reading it in the background lets the gateway leave a stream without closing it: on a
    migration it opens the continuation elsewhere first and closes this one only once the
    continuation has produced a token. The order matters: a resumed engine loads the
    checkpoint before its first token, and this engine frees that checkpoint on its holder
    as soon as its stream is closed."""

    def __init__(self, worker: str, session: aiohttp.ClientSession, urls: tuple[str, ...],
                 path: str, body: dict[str, Any], timeouts: ReadTimeouts | None = None) -> None:
        self.worker = worker
        self.path = path
        self._items: deque[object] = deque()
        self._more = asyncio.Event()
        self._migrate_pending = False
        self._finished = False  # a piece with a finish_reason was read
        self.migrate_not_before = 0.0  # monotonic: a declined move is not retried before
        self._task = asyncio.create_task(self._pump(session, urls, path, body, timeouts))

    async def _pump(self, session: aiohttp.ClientSession, urls: tuple[str, ...], path: str,
                    body: dict[str, Any], timeouts: ReadTimeouts | None) -> None:
        try:
            async with contextlib.aclosing(stream_from(session, urls, path, body,
                                                       timeouts)) as batches:
                async for batch in batches:
                    self._items.extend(batch)
                    self._more.set()
                    if not self._finished:
                        self._finished = any(p.finish_reason is not None for p in batch)
        except (EngineRefused, StreamBroken, EngineError) as exc:
            self._put(exc)
        except Exception as exc:  # never leave the reader waiting
            self._put(StreamBroken(f"{type(exc).__name__}: {exc}"))
        else:
            self._put(_END)

    def _put(self, item: object) -> None:
        self._items.append(item)
        self._more.set()

    async def _next(self) -> object:
        while not self._items:
            self._more.clear()
            await self._more.wait()
        return self._items.popleft()

    def migrate(self) -> None:
        """Ask the reader to move the request elsewhere (after the pieces already read)."""
        if not self._migrate_pending:
            self._migrate_pending = True
            self._put(_MIGRATE)

    def stay(self, retry_after_s: float) -> None:
        """The move did not happen; the request goes on here (asked again no sooner than
        `retry_after_s` from now)."""
        self.migrate_not_before = time.monotonic() + retry_after_s

    def more_ready(self) -> bool:
        """Whether a piece read is waiting (the caller can hold its write for it; not for
        a break, whose resume may take a while)."""
        return bool(self._items) and isinstance(self._items[0], Piece)

    async def pieces(self) -> AsyncIterator[Piece]:
        """The pieces, in order; raises what ended the stream (EngineRefused, StreamBroken,
        EngineError for a 4xx) or MigrateAway when `migrate` was asked."""
        items = self._items
        while True:
            item = items.popleft() if items else await self._next()
            if item is _END:
                return
            if item is _MIGRATE:
                self._migrate_pending = False
                raise MigrateAway(f"moving off {self.worker}")
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, Piece)
            yield item

    async def started(self) -> BaseException | None:
        """Wait for the first piece (it stays to be read): None once the stream has one,
        else why it never will (a stream that ends with no piece: StreamBroken)."""
        while True:
            item = await self._next()
            if item is _MIGRATE:  # not ours to answer before the stream starts
                self._migrate_pending = False
                continue
            self._items.appendleft(item)
            if isinstance(item, Piece):
                return None
            if isinstance(item, BaseException):
                return item
            return StreamBroken("the engine ended the stream without a token")

    async def close(self) -> None:
        """Stop reading and close the engine's stream (the engine stops generating). A
        stream whose finish_reason was read has only `[DONE]` and its end to come: that is
        read in the background (within END_WAIT_S), and its connection is kept for the next
        request instead of closed."""
        if self._finished and not self._task.done():
            _ending.add(self._task)
            self._task.add_done_callback(_ending.discard)
            return
        self._task.cancel()
        await asyncio.wait({self._task})
