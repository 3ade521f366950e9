"""The data events of an OpenAI-style server-sent event stream, as a client reads them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any


async def data_events(lines: AsyncIterable[bytes]) -> AsyncIterator[dict[str, Any]]:
    """Each `data:` event's JSON object, up to `data: [DONE]` (other lines are skipped)."""
    async for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        if line == "data: [DONE]":
            return
        chunk = json.loads(line[5:])
        if isinstance(chunk, dict):
            yield chunk
