"""A stop string matched by the gateway inside a chunk of several tokens (speculative
decoding): the request reports the ids through the token that completed the stop, as the
engine does when it matches the stop itself, wherever the chunks happen to break.

Found on vLLM (tests/vllm/test_vllm_gateway_resume.py): a resumed stream is chunked
differently from the failure-free one, and the gateway passed on all of the stopping
chunk's ids, so the two reported different token ids (3 past the stop) for the same text.
Then, on vLLM again: a stop completed by a token whose bytes go on into the next character
("sk" of "sk\\xc3") is emitted, and its ids kept, through the token completing that
character; the gateway had counted the ids through the first token (5 ids apart).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from lumend.engine.sim_tokenizer import decode, utf8_tail, vocabulary

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
        # Stops at many places, so that most of them end inside a chunk of several tokens,
        # and stops ending in a token whose bytes then open another character: the engine
        # emits that text (and keeps the ids through) only with the token completing it.
        stops = sorted({text[at:at + 2] for at in range(8, len(text) - 2, len(text) // 12)})
        opening = stops_before_an_opening(free["token_ids"], text)
        assert opening, "the free run has no token that completes text and opens a character"
        stops = sorted({*stops, *opening})
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


def stops_before_an_opening(ids: list[int], text: str) -> list[str]:
    """Two-character stops that end where a token's whole characters end and its trailing
    bytes begin another character (first occurrences in `text`, no U+FFFD)."""
    vocab = vocabulary("bpe")
    found = []
    for k, token in enumerate(ids):
        piece = vocab.token_bytes(token)
        tail = utf8_tail(piece)
        if not tail or len(tail) == len(piece) or utf8_tail(b"".join(
                vocab.token_bytes(t) for t in ids[:k])):
            continue  # no whole character in it, or it continues an open one
        upto = decode(vocab, ids[:k + 1]).rstrip("\ufffd")
        stop = upto[-2:]
        if len(stop) == 2 and "\ufffd" not in stop and text.find(stop) == len(upto) - 2:
            found.append(stop)
    return found


def test_stop_ids_match_the_engines_own(tmp_path: Path) -> None:
    asyncio.run(_test_stop_ids_match_the_engines_own(tmp_path))
