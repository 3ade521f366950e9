"""Reading a gateway's streamed completion in tests: ids, text and errors, over the
project's own SSE reader (`lumenctl.sse.data_events`)."""

from __future__ import annotations

import aiohttp

from lumenctl.sse import data_events


async def read_stream(r: aiohttp.ClientResponse, chat: bool = False,
                      received: list[int] | None = None) -> tuple[set[str], str, list[str]]:
    """(ids seen, text received, errors) of a streamed completion's response; `received`
    counts its chunks as they come."""
    ids, pieces, errors = set(), [], []
    async for chunk in data_events(r.content):
        if "error" in chunk:
            errors.append(chunk["error"]["message"])
            continue
        ids.add(chunk["id"])
        choice = chunk["choices"][0]
        pieces.append(choice["delta"].get("content", "") if chat else choice["text"])
        if received is not None:
            received[0] += 1
    return ids, "".join(pieces), errors
