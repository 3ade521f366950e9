"""Talking to engines: one streamed completion from a worker, read in the background (so a
migration can open its continuation before closing it), as pieces carrying token ids."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec


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


@dataclass(frozen=True)
class Piece:
    """One chunk of an engine's stream, for the request's only choice."""

    text: str
    finish_reason: str | None
    token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] | None = None  # on the first chunk only
    stop_reason: str | int | None = None
    logprobs: dict[str, Any] | None = None  # the engine's, in its endpoint's format


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


def _piece_of(data: bytes) -> Piece | None:
    """One SSE `data:` payload as a Piece (None for one without a choice); raises
    StreamBroken for an error event."""
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


async def stream_from(session: aiohttp.ClientSession, urls: tuple[str, ...], path: str,
                      body: dict[str, Any], timeouts: ReadTimeouts | None = None
                      ) -> AsyncGenerator[list[Piece], None]:
    """Pieces of one streamed completion from the first engine that accepts it, in batches:
    all the pieces that arrived in one read (a busy engine's chunks come several at a time,
    and handing them on together saves the gateway a wake-up per chunk).

    Raises `EngineRefused` if none accepts, `EngineError` for a 4xx, `StreamBroken` if the
    accepted stream ends before `[DONE]` or goes quiet (`timeouts`)."""
    timeouts = timeouts or ReadTimeouts()
    response = None
    for url in urls:
        try:
            response = await session.post(url + path, json=body)
        except (aiohttp.ClientError, TimeoutError):
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
        response.release()  # 503 from a standby, or an engine in trouble: try the next
        response = None
    if response is None:
        raise EngineRefused(f"no engine of {', '.join(urls)} accepted the request")
    done = False
    tokens = 0
    partial = b""
    try:
        while True:
            wait = timeouts.first_token_s if not tokens else timeouts.inactivity_s
            try:
                async with asyncio.timeout(wait):
                    data = await response.content.readany()
            except TimeoutError:
                raise StreamBroken(f"no token for {wait:g} s ("
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
                    batch.append(piece)
            if batch:
                yield batch
            if done:
                return
        raise StreamBroken("the engine closed the stream before [DONE]")
    except aiohttp.ClientError as exc:
        raise StreamBroken(f"{type(exc).__name__}: {exc}") from exc
    finally:
        if done:
            response.release()
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
        while True:
            item = await self._next()
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
        """Stop reading and close the engine's stream (the engine stops generating)."""
        self._task.cancel()
        await asyncio.wait({self._task})
