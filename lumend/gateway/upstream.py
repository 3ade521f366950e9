"""Talking to engines: one streamed completion from a worker, and the body that resumes an
interrupted one."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
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
