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
    """Built in pieces: a stop string is searched for in the text's last characters only,
    and the text is joined once, so a stream of any length costs the same per token."""

    def __init__(self, vocab: Vocabulary, prompt: Sequence[int], stop: Sequence[str],
                 include_stop_str_in_output: bool = False) -> None:
        self.stream = DecodeStream(vocab, prompt)
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.hold_back = max(len(s) for s in stop) - 1 if stop and not self.include_stop else 0
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._pieces: list[str] = []
        self._length = 0
        self._recent = ""  # the text's last characters, where a new stop string can start
        self._unsent = ""
        self._sent = 0

    @property
    def text(self) -> str:
        joined = "".join(self._pieces)
        self._pieces = [joined]
        return joined

    def update(self, tokens: Sequence[int], stop_terminated: bool) -> tuple[str | None, int]:
        """Add a step's tokens; returns (the stop string matched or None, how many of the
        tokens to keep). A stop token's own text is never added, as in vLLM."""
        decoded = list(tokens[:-1]) if stop_terminated else list(tokens)
        offsets = [self._length]
        new = []
        for token in decoded:
            piece = self.stream.step(token)
            if piece:
                new.append(piece)
                self._length += len(piece)
            offsets.append(self._length)
        if stop_terminated:
            offsets.append(self._length)
        fresh = "".join(new)
        self._pieces.append(fresh)
        self._unsent += fresh
        if not self.stop:
            return None, len(tokens)
        window = self._recent + fresh
        self._recent = window[-self._longest_stop:]
        found = _find_stop(window, len(fresh), self.stop, self.include_stop)
        if found is None:
            return None, len(tokens)
        stop, truncate_to = found
        start = self._length - len(window)  # where the window starts in the whole text
        end = self._length if truncate_to == -1 else start + truncate_to
        if not self.include_stop:
            end += len(stop)
        kept = bisect.bisect_left(offsets, end, lo=1)
        if truncate_to != -1:
            cut = start + truncate_to
            self._pieces = [self.text[:cut]]
            self._unsent = self._unsent[:cut - self._sent]
            self._length = cut
        return stop, kept

    def delta(self, finished: bool) -> str:
        """New text to send now: all of it once finished, else all but the hold-back."""
        ready = self._length - (0 if finished else self.hold_back) - self._sent
        if ready <= 0:
            return ""
        piece, self._unsent = self._unsent[:ready], self._unsent[ready:]
        self._sent += ready
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
