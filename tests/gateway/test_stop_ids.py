"""A stop string matched by the gateway inside a chunk of several tokens (speculative
decoding): the request reports the ids through the token that completed the stop, as the
engine does when it matches the stop itself, wherever the chunks happen to break.

Found on vLLM (tests/vllm/test_vllm_gateway_resume.py): a resumed stream is chunked
differently from the failure-free one, and the gateway passed on all of the stopping
chunk's ids, so the two reported different token ids (3 past the stop) for the same text.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from .test_resume_semantics import BPE, call, cluster


async def _test_stop_ids_match_the_engines_own(tmp_path: Path) -> None:
    async with cluster(tmp_path, BPE, workers=1) as (_, base, sups), \
            aiohttp.ClientSession() as session:
        engine = sups[0].record().engines[0].url
        body = {"prompt": "東京は日本の首都です 😀", "max_tokens": 160, "stream": True,
                "return_token_ids": True}
        free = await call(session, engine, False, body)
        text = free["text"]
        assert free["chunks"] < len(free["token_ids"]), "no chunk carried several tokens"
        # Stops at many places, so that most of them end inside a chunk of several tokens.
        stops = sorted({text[at:at + 2] for at in range(8, len(text) - 2, len(text) // 12)})
        pairs = []
        for stop in stops:
            asked = {**body, "stop": [stop]}
            pairs.append((stop, await call(session, engine, False, asked),
                          await call(session, base, False, asked)))
    inside = 0
    for stop, direct, via in pairs:
        assert direct["status"] == via["status"] == 200, (stop, via["errors"])
        assert direct["finish"] == via["finish"] == "stop", stop
        assert via["text"] == direct["text"], stop
        assert via["token_ids"] == direct["token_ids"], (
            f"stop {stop!r}: {len(via['token_ids'])} ids through the gateway, "
            f"{len(direct['token_ids'])} from the engine")
        full = free["token_ids"]
        n = len(direct["token_ids"])
        inside += n < len(full) and full[:n] == direct["token_ids"]
    assert inside > 0, "no stop ended before the end of the free run: the test is void"


def test_stop_ids_match_the_engines_own(tmp_path: Path) -> None:
    asyncio.run(_test_stop_ids_match_the_engines_own(tmp_path))
