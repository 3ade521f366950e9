"""A request's output text, token by token, the way vLLM 0.32 produces it.

Two parts, both behaving like vLLM's `v1/engine/detokenizer.py` with a fast tokenizer:

- `DecodeStream`: tokenizers' incremental decoder, primed with the prompt ids. It holds text
  back while the ids end in an incomplete UTF-8 character (a chunk then carries token ids
  and no text). Primed with a prompt that itself ends mid-character, its first text is the
  WHOLE decoded context (prompt included), not just the new characters: tokenizers
  restarts from an empty prefix there, and vLLM passes that text on. A client resuming a
  stream by ids at such a point gets text it already has; the sim engine does the same so
  the gateway's tests see it.
- `OutputText`: stop strings on top (the first to complete wins, the text is cut before it,
  tokens after the one completing it are dropped) and the hold-back of the last
  `max(len(stop)) - 1` characters while streaming, so no part of a stop string is sent.
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Sequence

from lumend.engine.sim_tokenizer import Vocabulary, decode

REPLACEMENT = "\ufffd"


class DecodeStream:
    def __init__(self, vocab: Vocabulary, prompt: Sequence[int]) -> None:
        self.vocab = vocab
        self.ids = list(prompt)
        text = decode(vocab, self.ids)
        if text.endswith(REPLACEMENT):
            self.prefix, self.prefix_index = "", 0
        else:
            self.prefix, self.prefix_index = text, len(self.ids)

    def step(self, token: int) -> str:
        """The text `token` completes ("" while a character is incomplete)."""
        self.ids.append(token)
        text = decode(self.vocab, self.ids)
        whole, prefix = text.encode(), self.prefix.encode()
        if len(whole) <= len(prefix) or text.endswith(REPLACEMENT):
            return ""
        if not whole.startswith(prefix):
            # tokenizers' "invalid prefix" error: vLLM starts a fresh stream at this token.
            self.ids, self.prefix, self.prefix_index = [], "", 0
            return self.step(token)
        new_text = whole[len(prefix):].decode("utf-8", "replace")
        new_prefix_index = len(self.ids) - self.prefix_index
        self.ids = self.ids[self.prefix_index:]
        self.prefix = decode(self.vocab, self.ids)
        self.prefix_index = new_prefix_index
        return new_text


class OutputText:
    def __init__(self, vocab: Vocabulary, prompt: Sequence[int], stop: Sequence[str],
                 include_stop_str_in_output: bool = False) -> None:
        self.stream = DecodeStream(vocab, prompt)
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.hold_back = max(len(s) for s in stop) - 1 if stop and not self.include_stop else 0
        self.text = ""
        self._sent = 0

    def update(self, tokens: Sequence[int], stop_terminated: bool) -> tuple[str | None, int]:
        """Add a step's tokens; returns (the stop string matched or None, how many of the
        tokens to keep). A stop token's own text is never added, as in vLLM."""
        decoded = list(tokens[:-1]) if stop_terminated else list(tokens)
        offsets = [len(self.text)]
        for token in decoded:
            self.text += self.stream.step(token)
            offsets.append(len(self.text))
        if stop_terminated:
            offsets.append(len(self.text))
        if not self.stop:
            return None, len(tokens)
        found = _find_stop(self.text, len(self.text) - offsets[0], self.stop,
                           self.include_stop)
        if found is None:
            return None, len(tokens)
        stop, truncate_to = found
        end = len(self.text) if truncate_to == -1 else truncate_to
        if not self.include_stop:
            end += len(stop)
        kept = bisect.bisect_left(offsets, end, lo=1)
        if truncate_to != -1:
            self.text = self.text[:truncate_to]
        return stop, kept

    def delta(self, finished: bool) -> str:
        """New text to send now: all of it once finished, else all but the hold-back."""
        length = len(self.text) - (0 if finished else self.hold_back)
        if self._sent >= length:
            return ""
        piece = self.text[self._sent:length]
        self._sent = length
        return piece


def _find_stop(text: str, new_chars: int, stop: Sequence[str],
               include_in_output: bool) -> tuple[str, int] | None:
    """(stop string, length to cut the text to or -1): the one completing earliest in the
    new text, ties by list order."""
    if not new_chars:
        return None
    best: tuple[str, int] | None = None
    best_end = sys.maxsize
    for candidate in stop:
        index = text.find(candidate, max(0, len(text) + 1 - new_chars - len(candidate)))
        if index == -1:
            continue
        end = index + len(candidate)
        if end < best_end:
            best, best_end = (candidate, index), end
    if best is None:
        return None
    candidate, index = best
    if include_in_output:
        return (candidate, -1) if best_end >= len(text) else (candidate, best_end)
    return candidate, index
