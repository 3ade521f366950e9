"""The sim engine's vocabularies: a tokenizer and the model's token function over it.

`byte` (the default): one printable-ASCII byte per token, so text re-encodes to the same
tokens (what the sim engine always did). `bpe`: a byte-level BPE-like vocabulary (256 byte
tokens, an EOS, merged tokens for ASCII pieces, accented Latin, CJK and emoji, including
partial UTF-8 sequences) whose model writes text rich in multi-byte characters, often split
over several tokens and rarely in the canonical encoding: `encode(decode(ids)) != ids`, as
with real byte-level BPE models, so a stream can only be resumed exactly by its token ids.

Either way the next token is a function of the context: a rolling digest of its ids
(`sim_core.context_state`) and, for `bpe`, the incomplete UTF-8 sequence it ends with
(`utf8_tail`), which the model always completes. Logprobs come from the same digest.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

CANDIDATES = 8  # tokens with probability mass at each position (sampling draws among them)
FILLER_LOGPROB = -25.0  # the rest of a requested top-k beyond the candidates


@dataclass(frozen=True)
class Ranked:
    """The model's distribution at one position: candidates, best first, with logprobs."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]

    def logprob(self, token: int) -> float:
        try:
            return self.logprobs[self.tokens.index(token)]
        except ValueError:
            return FILLER_LOGPROB - 5.0  # a token the model gives no mass to


class Vocabulary(Protocol):
    name: str
    eos_id: int
    size: int
    max_chars_per_token: int

    def encode(self, text: str) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def choose(self, state: int, tail: bytes) -> int:
        """The greedy next token after a context with digest `state` ending in `tail`."""
        ...

    def ranked(self, state: int, tail: bytes) -> Ranked: ...

    def filler(self, state: int, exclude: Sequence[int], n: int) -> list[int]:
        """`n` tokens outside `exclude`: the tail of a top-k list longer than the
        candidates (tokens the model gives almost no mass)."""
        ...


def decode(vocab: Vocabulary, tokens: Sequence[int]) -> str:
    """Ids -> text, special tokens skipped, invalid UTF-8 replaced (as tokenizers does)."""
    return b"".join(vocab.token_bytes(t) for t in tokens).decode("utf-8", "replace")


def token_text(vocab: Vocabulary, token: int) -> str:
    """One token alone, as vLLM shows it in logprobs: a partial character is U+FFFD."""
    return vocab.token_bytes(token).decode("utf-8", "replace")


def sequence_length(lead: int) -> int:
    """Bytes in a UTF-8 sequence starting with `lead`; 0 for a byte that starts none."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def utf8_tail(data: bytes) -> bytes:
    """The incomplete UTF-8 sequence `data` ends with (b"" when it ends on a boundary)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # the last byte that is not a continuation
            need = sequence_length(byte)
            return data[-back:] if need > back else b""
    return b""


def tail_after(vocab: Vocabulary, tail: bytes, token: int) -> bytes:
    return utf8_tail(tail + vocab.token_bytes(token))


def context_tail(vocab: Vocabulary, tokens: Sequence[int]) -> bytes:
    return utf8_tail(b"".join(vocab.token_bytes(t) for t in tokens[-4:]))


def _spread(state: int) -> bytes:
    return hashlib.blake2b(state.to_bytes(8, "big"), digest_size=32).digest()


def _logprobs(digest: bytes, n: int) -> tuple[float, ...]:
    """Decreasing logits from the digest, normalised with a share left for the rest of
    the vocabulary: deterministic per context, so a resumed stream reports the same."""
    logits = [0.0]
    for i in range(1, n):
        logits.append(logits[-1] - 0.3 - 3.0 * digest[i] / 255)
    rest = -1.5 - 2.0 * digest[0] / 255
    norm = math.log(sum(math.exp(v) for v in logits) + math.exp(rest))
    return tuple(v - norm for v in logits)


def _distinct(first: int, digest: bytes, pool: Sequence[int], n: int) -> tuple[int, ...]:
    """`first`, then up to n-1 other tokens of `pool` picked by the digest (then in order)."""
    out = [first]
    picks = [pool[b % len(pool)] for b in digest] + list(pool)
    for pick in picks:
        if len(out) == n:
            break
        if pick not in out:
            out.append(pick)
    return tuple(out)


# -- byte ----------------------------------------------------------------------------------

FIRST_TOKEN = 32  # " "
PRINTABLE = 95  # " " .. "~"


class ByteVocabulary:
    """One token per byte; the model writes printable ASCII only (ids 32..126)."""

    name = "byte"
    eos_id = 0  # emitted only when the engine runs with an EOS rate
    size = 256
    max_chars_per_token = 1

    def encode(self, text: str) -> list[int]:
        return [b if FIRST_TOKEN <= b < FIRST_TOKEN + PRINTABLE
                else FIRST_TOKEN + b % PRINTABLE for b in text.encode("utf-8")]

    def token_bytes(self, token: int) -> bytes:
        return b"" if token == self.eos_id else bytes((token,))

    def choose(self, state: int, tail: bytes) -> int:
        return FIRST_TOKEN + state % PRINTABLE

    def ranked(self, state: int, tail: bytes) -> Ranked:
        digest = _spread(state)
        pool = range(FIRST_TOKEN, FIRST_TOKEN + PRINTABLE)
        tokens = _distinct(self.choose(state, tail), digest, pool, CANDIDATES)
        return Ranked(tokens, _logprobs(digest, len(tokens)))

    def filler(self, state: int, exclude: Sequence[int], n: int) -> list[int]:
        return [t for t in range(FIRST_TOKEN, FIRST_TOKEN + PRINTABLE)
                if t not in exclude][:n]


# -- bpe -----------------------------------------------------------------------------------

_ASCII_PIECES = [
    " the", " and", " of", " to", " in", " is", " it", " that", " for", " on", "the", "th",
    "he", "in", "er", "an", "re", "on", "ing", "ed", "es", " a", " t", " s", " c", " w",
    ", ", ". ", "lu", "men", " stream", " token", "ck", "pt", "\n",
]
_LATIN = "éèàüöñçßøåêôîûäëïá"
_CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年好学生"
_CJK_WORDS = ["中国", "我们", "你好", "学生", "时间", "人工智能"]
_EMOJI = "😀😂🙂😉🎉🚀👍🌍🔥🤖✨❤"
_MIXED = [" 中", " é", "é ", "。", "\uff0c", "\uff01"]  # fullwidth comma, exclamation


def _bpe_pieces() -> list[bytes]:
    pieces: list[bytes] = []
    text = (_ASCII_PIECES + list(_LATIN) + list(_CJK) + _CJK_WORDS + list(_EMOJI)
            + _MIXED)
    for piece in text:
        encoded = piece.encode("utf-8")
        if len(encoded) > 1:
            pieces.append(encoded)
    # Partial sequences, as byte-level BPE learns them: the first two bytes of common CJK
    # characters, their last two, and the emoji prefixes.
    for char in _CJK[:16]:
        encoded = char.encode("utf-8")
        pieces += [encoded[:2], encoded[1:]]
    pieces += [b"\xf0\x9f", b"\xf0\x9f\x98", b"\xf0\x9f\x8e", b"\xc3"]
    # Whole characters and then the first byte(s) of another (" caf" and the lead byte of
    # "é"), as byte-level BPE learns them: such a token's text is emitted only with the
    # token that completes the character after it.
    pieces += [b"sk\xc3", b" caf\xc3", "です".encode() + "東".encode()[:2], b" a\xf0\x9f"]
    return [p for p in dict.fromkeys(pieces) if len(p) > 1]


class BpeVocabulary:
    """Byte-level BPE-like: ids 0..255 are bytes, 256 is EOS, the rest merged pieces;
    `encode` takes the longest piece at each position (canonical), the model does not:
    it often opens a character with a lead byte or a partial piece and completes it with
    continuation tokens, as byte-level BPE models do."""

    name = "bpe"
    eos_id = 256

    def __init__(self) -> None:
        self.pieces = [bytes((b,)) for b in range(256)] + [b""] + _bpe_pieces()
        self.size = len(self.pieces)
        self.ids = {p: i for i, p in enumerate(self.pieces) if i != self.eos_id}
        self.longest = max(len(p) for p in self.pieces)
        self.max_chars_per_token = max(len(p.decode("utf-8", "ignore")) for p in self.pieces)
        whole: list[int] = []  # pieces made of whole characters
        openings: list[int] = []  # pieces that leave a character to complete
        for i, piece in enumerate(self.pieces):
            if i == self.eos_id or piece[0] & 0xC0 == 0x80:
                continue
            if utf8_tail(piece):
                openings.append(i)
            elif len(piece) > 1 or 0x61 <= piece[0] <= 0x7A or piece[0] == 0x20:
                whole.append(i)
        openings = [i for i in openings if len(self.pieces[i]) > 1 or self.pieces[i][0] in
                    (0xC3, 0xE4, 0xE5, 0xE6, 0xE7, 0xE8, 0xE9, 0xF0)]
        self.starts = whole + openings * 6
        self.ascii = [i for i in whole if self.pieces[i][0] < 0x80]
        self.continuation_pairs = [i for i in range(self.eos_id + 1, self.size)
                                   if all(b & 0xC0 == 0x80 for b in self.pieces[i])]
        self.chars = [p for p in self.pieces if len(p.decode("utf-8", "ignore")) == 1
                      and len(p) > 1 and not utf8_tail(p)]
        self._continuing: dict[bytes, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        out: list[int] = []
        i = 0
        while i < len(data):
            for size in range(min(self.longest, len(data) - i), 0, -1):
                token = self.ids.get(data[i:i + size])
                if token is not None:
                    out.append(token)
                    i += size
                    break
        return out

    def token_bytes(self, token: int) -> bytes:
        return self.pieces[token]

    def _continuations(self, tail: bytes) -> list[int]:
        """Tokens that continue the incomplete character `tail` and keep the text valid
        UTF-8: first those completing a character of the vocabulary (so the model writes
        known characters in non-canonical pieces), then any valid byte."""
        cached = self._continuing.get(tail)
        if cached is None:
            cached = self._continuing[tail] = self._continuations_of(tail)
        return cached

    def _continuations_of(self, tail: bytes) -> list[int]:
        known: list[int] = []
        for char in self.chars:
            if char.startswith(tail) and len(char) > len(tail):
                rest = char[len(tail):]
                known.append(self.ids.get(rest, rest[0]))
        need = sequence_length(tail[0]) - len(tail)
        low, high = 0x80, 0xBF
        if len(tail) == 1:  # the second byte is constrained after some leads
            low, high = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x9F, 0x9F),
                         0xF4: (0x80, 0x8F)}.get(tail[0], (low, high))
        if tail == b"\xf0\x9f":
            low, high = 0x98, 0x99  # faces and gestures
        valid = list(range(low, high + 1))
        if need == 2 and sequence_length(tail[0]) == 3 and low == 0x80 and high == 0xBF:
            valid += self.continuation_pairs
        known = list(dict.fromkeys(known))
        return known * (64 // len(known) if known else 0) + valid

    def _pool(self, tail: bytes) -> list[int]:
        return self._continuations(tail) if tail else self.starts

    def choose(self, state: int, tail: bytes) -> int:
        pool = self._pool(tail)
        return pool[state % len(pool)]

    def ranked(self, state: int, tail: bytes) -> Ranked:
        digest = _spread(state)
        pool = self._pool(tail)
        tokens = _distinct(pool[state % len(pool)], digest, pool, CANDIDATES)
        return Ranked(tokens, _logprobs(digest, len(tokens)))

    def filler(self, state: int, exclude: Sequence[int], n: int) -> list[int]:
        return [t for t in self.ascii if t not in exclude][:n]


VOCABULARIES = ("byte", "bpe")


def vocabulary(name: str) -> Vocabulary:
    if name == "byte":
        return ByteVocabulary()
    if name == "bpe":
        return BpeVocabulary()
    raise ValueError(f"unknown sim tokenizer {name!r}; use one of {', '.join(VOCABULARIES)}")
