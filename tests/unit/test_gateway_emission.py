"""Which ids a stopped request keeps (lumend/gateway/emission.py), against vLLM's rule: a
stop string completes at the token where the detokenizer emits the text holding it, and
the detokenizer emits nothing while the text ends in an incomplete character, so whatever
follows its last emission point waits (a final U+FFFD of invalid bytes included). Decoded
by the sim engine's byte-level BPE vocabulary, as tokenizers decodes (invalid UTF-8
replaced)."""

from __future__ import annotations

import asyncio
import random

from lumend.engine.sim_tokenizer import BpeVocabulary, decode
from lumend.gateway.emission import CONTEXT_IDS, INCOMPLETE, ids_through_stop

VOCAB = BpeVocabulary()


async def detok(ids: list[int]) -> str:
    return decode(VOCAB, ids)


def emitted(ids: list[int]) -> list[str]:
    """The text an engine had emitted after each id, as vLLM's incremental detokenizer."""
    out, text = [], ""
    for i in range(len(ids)):
        full = decode(VOCAB, ids[:i + 1])
        if not full.endswith(INCOMPLETE):
            text = full
        out.append(text)
    return out


def piece(data: bytes) -> int:
    return VOCAB.ids[data]


def test_held_text_that_is_not_only_incomplete_characters() -> None:
    """The context ends with held text that holds a whole character between two broken
    ones ("\\ufffdsk\\ufffd"): the chunk's text starts with all of it. Stripping only the
    trailing U+FFFD (as the gateway did) misaligned the chunk and kept every id."""
    context = [*VOCAB.encode("hello "), 0xC3, piece(b"sk\xc3")]
    context = [ord("x")] * 20 + context  # more than CONTEXT_IDS: not the stream's start
    prefix = "x" * 20 + "hello "
    assert decode(VOCAB, context) == prefix + "\ufffdsk\ufffd"
    chunk = [0xA9, ord("x"), ord("y"), ord(" ")]  # completes "é"
    text = decode(VOCAB, [*context, *chunk])[len(prefix):]
    assert text == "\ufffdskéxy "
    stop_end = text.index("éx") + 2
    assert asyncio.run(ids_through_stop(detok, context, chunk, text, stop_end)) == 2


def test_one_id_and_no_emission_point_keep_the_chunk() -> None:
    assert asyncio.run(ids_through_stop(detok, [ord("a")], [ord("b")], "b", 1)) == 1
    broken = [0xE4] * (CONTEXT_IDS + 4)  # no whole character anywhere in the context
    chunk = [ord("a"), ord("b")]
    text = decode(VOCAB, [*broken, *chunk])
    assert asyncio.run(ids_through_stop(detok, broken, chunk, text, text.index("a") + 1)) == 2


def test_random_streams_keep_the_ids_vllm_keeps() -> None:
    """Random byte-level id sequences (whole pieces, partial ones, stray bytes), cut into
    random chunks; a stop string taken from the emitted text. The ids kept through the
    chunk that completes the stop equal the engine's: through its first emission point
    whose text holds the stop."""
    rng = random.Random(7)
    pool = [*range(0x20, 0x7F), 0xC3, 0xA9, 0xE4, 0xB8, 0x80, 0xFF,
            *range(VOCAB.eos_id + 1, VOCAB.size)]
    checked = 0
    for _ in range(400):
        ids = [rng.choice(pool) for _ in range(rng.randrange(6, 60))]
        texts = emitted(ids)
        final = texts[-1]
        if len(final) < 4:
            continue
        at = rng.randrange(1, len(final) - 1)
        stop = final[at:at + rng.choice((1, 2, 3))]
        engine_keeps = next(i + 1 for i, t in enumerate(texts) if stop in t)
        # The gateway's view: chunks of 1-4 ids, each with the text emitted meanwhile.
        start, sent = 0, ""
        while True:
            end = min(len(ids), start + rng.randrange(1, 5))
            text = texts[end - 1][len(texts[start - 1]) if start else 0:]
            if stop in sent + text:
                stop_end = (sent + text).index(stop) + len(stop) - len(sent)
                keep = asyncio.run(ids_through_stop(detok, ids[:start], ids[start:end], text,
                                                    stop_end))
                assert start + keep == engine_keeps, (ids, stop, start, end)
                checked += 1
                break
            sent += text
            start = end
    assert checked > 300
