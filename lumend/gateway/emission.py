"""Where an engine's incremental decoder emits text, and so which ids a stopped request keeps.

vLLM's detokenizer emits the text of new tokens only once the whole text no longer ends in
an incomplete character (rendered U+FFFD): everything after its last emission point waits,
final U+FFFDs of invalid bytes included. A stop string completes at the token where the
text containing it is emitted, and vLLM keeps a stopped request's ids through that token.
The gateway matches stop strings itself (engines never see them), so it must cut the ids
of the chunk that completes a stop by the same rule, or the ids a request reports would
depend on where its chunks broke (a resumed stream breaks them elsewhere).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

INCOMPLETE = "\ufffd"  # how a tokenizer's decode renders bytes that are no whole character

# Ids before a chunk given as its context: enough that one of them is an emission point
# (a model that writes more than this many tokens without a whole character is unheard of).
CONTEXT_IDS = 16

# The text of some ids by the target engine's tokenizer; None when it has no /detokenize.
Detokenize = Callable[[list[int]], Awaitable[str | None]]


async def ids_through_stop(detokenize: Detokenize, before: Sequence[int],
                           ids: Sequence[int], text: str, stop_end: int,
                           prompt: Sequence[int] = ()) -> int:
    """How many of a chunk's `ids` an engine keeps when the chunk's `text` completes a stop
    string `stop_end` characters into it: through the first emission point at which the
    emitted text reaches the stop's end. `before` is every id generated before the chunk
    (its last CONTEXT_IDS are rendered), `prompt` the request's prompt ids (where the
    output's text starts, when few ids came before). All of them when it cannot tell (no
    /detokenize, no emission point among the context, a rendering that is not the
    chunk's)."""
    if len(ids) < 2:
        return len(ids)
    from_start = len(before) <= CONTEXT_IDS
    tail = list(before[-CONTEXT_IDS:])
    head = list(prompt[-CONTEXT_IDS:]) if from_start else []

    async def render(ids: list[int]) -> str | None:
        return "" if not ids else await detokenize(ids)

    # Mostly the context ends on an emission point: one rendering of it, with the chunk's.
    whole, *fulls = await asyncio.gather(render([*head, *tail]),
                                         *(render([*head, *tail, *ids[:k]])
                                           for k in range(1, len(ids))))
    if whole is None:
        return len(ids)
    base: str | None = whole if tail and not whole.endswith(INCOMPLETE) else None
    if base is None and tail:
        # The text emitted before the chunk ends at the context's last emission point: the
        # longest prefix whose rendering does not end in an incomplete character.
        shorter = await asyncio.gather(*(render([*head, *tail[:j]])
                                         for j in range(1, len(tail))))
        for rendered in reversed(shorter):
            if rendered is None:
                return len(ids)
            if not rendered.endswith(INCOMPLETE):
                base = rendered
                break
    if base is None and from_start:
        # The prompt's end, where the output's text starts (its own last character, if the
        # prompt ends inside one, is completed by the output).
        start = whole if not tail else await render(head)
        base = None if start is None else start.rstrip(INCOMPLETE)
    if base is None:
        return len(ids)
    for k, full in enumerate(fulls, start=1):
        if full is None or not full.startswith(base):
            return len(ids)
        if full.endswith(INCOMPLETE):
            continue  # no emission at this token
        added = full[len(base):]
        if not text.startswith(added):
            return len(ids)  # special tokens rendered, or not the engine's chunk: unsure
        if len(added) >= stop_end:
            return k
    return len(ids)
