"""Talking to engines: one streamed completion from a worker (read in the background, so a
migration can open its continuation before closing it), and the body that resumes an
interrupted one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp


class EngineRefused(Exception):
    """Every engine of the worker refused or could not be reached before a token came."""


class StreamBroken(Exception):
    """The upstream stream ended early: connection lost, engine gone, or no token in time."""


@dataclass(frozen=True)
class Piece:
    text: str
    finish_reason: str | None


def resume_body(original: dict[str, Any], chat: bool, emitted: str,
                tokens_left: int) -> dict[str, Any]:
    """The request that continues `original` after `emitted`: the prompt plus what the client
    already has, for the tokens it still expects. Engines are deterministic functions of the
    context (greedy), so the continuation is what the lost engine would have sent."""
    body = {k: v for k, v in original.items() if k not in ("stream", "stream_options", "n")}
    body["stream"] = True
    body["max_tokens"] = tokens_left
    if not emitted:
        return body
    if chat:
        body["messages"] = [*original["messages"], {"role": "assistant", "content": emitted}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = original["prompt"] + emitted
    return body


async def stream_from(session: aiohttp.ClientSession, urls: tuple[str, ...], path: str,
                      body: dict[str, Any]) -> AsyncGenerator[Piece, None]:
    """Pieces of one streamed completion from the first engine that accepts it.

    Raises `EngineRefused` if none accepts, `StreamBroken` if the accepted stream ends
    before `[DONE]`."""
    response = None
    for url in urls:
        try:
            response = await session.post(url + path, json=body)
        except (aiohttp.ClientError, TimeoutError):
            continue
        if response.status == 200:
            break
        if response.status == 400:
            detail = await response.text()
            response.release()
            raise ValueError(detail)
        response.release()  # 503 from a standby, or an engine in trouble: try the next
        response = None
    if response is None:
        raise EngineRefused(f"no engine of {', '.join(urls)} accepted the request")
    done = False
    try:
        async for raw in response.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                return
            chunk = json.loads(data)
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                text = choice.get("text") if "text" in choice else delta.get("content")
                yield Piece(text or "", choice.get("finish_reason"))
        raise StreamBroken("the engine closed the stream before [DONE]")
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
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
                 path: str, body: dict[str, Any]) -> None:
        self.worker = worker
        self._items: deque[object] = deque()
        self._more = asyncio.Event()
        self._migrate_pending = False
        self.migrate_not_before = 0.0  # monotonic: a declined move is not retried before
        self._task = asyncio.create_task(self._pump(session, urls, path, body))

    async def _pump(self, session: aiohttp.ClientSession, urls: tuple[str, ...], path: str,
                    body: dict[str, Any]) -> None:
        try:
            async with contextlib.aclosing(stream_from(session, urls, path, body)) as pieces:
                async for piece in pieces:
                    self._put(piece)
        except (EngineRefused, StreamBroken, ValueError) as exc:
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

    async def pieces(self) -> AsyncIterator[Piece]:
        """The pieces, in order; raises what ended the stream (EngineRefused, StreamBroken,
        ValueError for a 400) or MigrateAway when `migrate` was asked."""
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
