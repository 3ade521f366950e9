"""The sim engine's model: deterministic tokens, KV pages and continuous batching.

Pure logic, no I/O: the HTTP server (`sim_server.py`) drives `Scheduler.step()` and
sleeps for the step time it returns.

Tokens are bytes in the printable ASCII range, so a completion's text re-encodes to the
exact same tokens: a request resumed elsewhere (prompt + text generated so far, sent as a
new prompt) continues with exactly the tokens a failure-free run would have produced.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

FIRST_TOKEN = 32  # " "
VOCAB = 95  # " " .. "~"
BLOCK_SIZE = 16

_MIX = struct.Struct(">QI")


def encode(text: str) -> list[int]:
    """Text -> tokens; bytes outside the vocabulary are mapped into it (lossy, stable)."""
    return [b if FIRST_TOKEN <= b < FIRST_TOKEN + VOCAB else FIRST_TOKEN + b % VOCAB
            for b in text.encode("utf-8")]


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("ascii")


def context_state(seed: int, tokens: list[int]) -> int:
    """A rolling digest of (seed, tokens): the next token is a function of it alone."""
    state = seed & 0xFFFFFFFFFFFFFFFF
    for t in tokens:
        state = _advance(state, t)
    return state


def _advance(state: int, token: int) -> int:
    digest = hashlib.blake2b(_MIX.pack(state, token), digest_size=8).digest()
    return int.from_bytes(digest, "big")


advance = _advance  # public: the draft function imitates the token function


def next_token(state: int) -> int:
    return FIRST_TOKEN + state % VOCAB


def block_hashes(seed: int, tokens: list[int], start: int = 0,
                 previous: bytes = b"") -> list[bytes]:
    """Chained hashes of the full blocks of `tokens` from block `start` (given the hash of
    block start-1): a block's hash names its tokens and every token before them, so the
    same prefix always maps to the same blocks, on any engine with the same seed."""
    out = []
    key = seed.to_bytes(8, "big")
    for i in range(start, len(tokens) // BLOCK_SIZE):
        block = bytes(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        previous = hashlib.blake2b(previous + block, key=key, digest_size=16).digest()
        out.append(previous)
    return out


def kv_page(block_hash: bytes, page_bytes: int) -> bytes:
    """The KV page of a block: bytes derived from its chained hash, so a restored page can
    be checked byte by byte against what the engine would have computed."""
    digest = hashlib.blake2b(block_hash, digest_size=64).digest()
    whole, rest = divmod(page_bytes, 64)
    # One allocation of the page (no oversized copy to cut): this runs for every saved block.
    return digest * whole + digest[:rest] if rest else digest * whole


@dataclass(frozen=True)
class StepCost:
    """Step time as `a + b*prefill + c*prefill^2 + d*decode_batch + e*decode_context`."""

    a: float
    b: float
    c: float
    d: float
    e: float

    def seconds(self, prefill_tokens: int, decode_batch: int, decode_context: int) -> float:
        return (self.a + self.b * prefill_tokens + self.c * prefill_tokens**2
                + self.d * decode_batch + self.e * decode_context)


@dataclass(eq=False)
class SimRequest:
    id: str
    prompt: list[int]
    max_tokens: int
    emit: Callable[[int | None], None]  # a token, or None when finished
    prefilled: int = 0
    output: list[int] = field(default_factory=list)
    state: int = 0
    cancelled: bool = False
    chain: list[bytes] = field(default_factory=list)  # hashes of the full blocks computed

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.output)

    def blocks(self) -> int:
        return -(-self.context_len // BLOCK_SIZE)

    def computed_tokens(self) -> list[int]:
        """Tokens whose KV exists: the prefilled prompt and every output token but the
        newest (its KV is computed by the next step)."""
        if self.prefilled < len(self.prompt):
            return self.prompt[: self.prefilled]
        return self.prompt + self.output[:-1]

    def new_full_blocks(self, seed: int) -> list[tuple[int, bytes]]:
        """Blocks that became full since the last call: (index, chained hash)."""
        start = len(self.chain)
        computed = (self.prefilled if self.prefilled < len(self.prompt)
                    else len(self.prompt) + max(0, len(self.output) - 1))
        if computed // BLOCK_SIZE <= start:
            return []  # called every step for every saving request: skip the token copy
        fresh = block_hashes(seed, self.computed_tokens(), start,
                             self.chain[-1] if self.chain else b"")
        self.chain.extend(fresh)
        return list(enumerate(fresh, start))


@dataclass
class SchedulerLimits:
    max_batch: int = 64
    prefill_chunk: int = 512
    kv_blocks: int = 4096


class Scheduler:
    """Continuous batching with chunked prefill (one chunk budget per step)."""

    def __init__(self, seed: int, cost: StepCost, limits: SchedulerLimits) -> None:
        self.seed = seed
        self.cost = cost
        self.limits = limits
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.steps = 0
        self.tokens_generated = 0
        self.prefill_tokens = 0  # prompt tokens computed (restored blocks are not)
        self.drafted_tokens = 0  # draft-assist: drafted tokens verified
        self.accepted_tokens = 0  # ... and accepted

    def add(self, request: SimRequest) -> None:
        request.state = context_state(self.seed, request.prompt)
        self.waiting.append(request)

    @property
    def kv_blocks_used(self) -> int:
        return sum(r.blocks() for r in self.running)

    def kv_usage(self) -> float:
        return min(1.0, self.kv_blocks_used / self.limits.kv_blocks)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def begin_step(self) -> tuple[float, list[SimRequest]]:
        """Schedule one iteration: returns its modelled duration and the requests that will
        have a new token when it ends (`end_step`)."""
        self.running = [r for r in self.running if not r.cancelled]
        while self.waiting and self.waiting[0].cancelled:
            self.waiting.popleft()
        # Admit waiting requests while the batch and KV pool have room.
        while (self.waiting and len(self.running) < self.limits.max_batch
               and self.kv_blocks_used + self.waiting[0].blocks() + 1 <= self.limits.kv_blocks):
            self.running.append(self.waiting.popleft())

        budget = self.limits.prefill_chunk
        prefill_tokens = 0
        decoding: list[SimRequest] = []
        for r in self.running:
            remaining = len(r.prompt) - r.prefilled
            if remaining > 0:
                chunk = min(remaining, budget)
                r.prefilled += chunk
                budget -= chunk
                prefill_tokens += chunk
                if r.prefilled == len(r.prompt):
                    decoding.append(r)  # the last prefill chunk also yields a token
            else:
                decoding.append(r)
        context = sum(r.context_len for r in decoding)
        self.prefill_tokens += prefill_tokens
        return self.cost.seconds(prefill_tokens, len(decoding), context), decoding

    def verify_seconds(self, drafted_tokens: int) -> float:
        """What verifying drafted tokens adds to a step: they are computed like prompt
        tokens (speculative decoding's k extra tokens per request)."""
        return self.cost.b * drafted_tokens

    def end_step(self, decoding: list[SimRequest],
                 drafts: Mapping[str, Sequence[int]] | None = None) -> None:
        """Commit each request's next token; with `drafts` (tokens proposed after a
        request's context), also every drafted token that matches the target's, up to the
        first that does not: the longest matching prefix plus one token of the target's
        own, as speculative decoding verifies them. The output is the same either way."""
        for r in decoding:
            if r.cancelled:
                continue
            proposal = drafts.get(r.id, ()) if drafts else ()
            # Tokens past max_tokens are never verified (nor counted as drafted).
            proposal = proposal[:max(0, r.max_tokens - len(r.output) - 1)]
            self.drafted_tokens += len(proposal)
            matched = 0
            while True:
                token = next_token(r.state)
                r.state = _advance(r.state, token)
                r.output.append(token)
                self.tokens_generated += 1
                r.emit(token)
                if len(r.output) >= r.max_tokens:
                    r.emit(None)
                    break
                if matched < len(proposal) and proposal[matched] == token:
                    matched += 1
                    continue
                break
            self.accepted_tokens += matched
        self.running = [r for r in self.running
                        if len(r.output) < r.max_tokens and not r.cancelled]
        self.steps += 1


def reference_completion(seed: int, prompt: list[int], max_tokens: int) -> list[int]:
    """What any sim engine with `seed` answers for `prompt`: the check for resumed streams."""
    state = context_state(seed, prompt)
    out = []
    for _ in range(max_tokens):
        token = next_token(state)
        out.append(token)
        state = _advance(state, token)
    return out


# -- sleep and wake (vLLM's sleep mode, same levels and tags) ------------------------------

SLEEP_LEVELS = {0: (), 1: ("kv_cache",), 2: ("kv_cache", "weights")}
MEMORY_TAGS = ("weights", "kv_cache")


@dataclass
class SleepState:
    """What an engine holds, as vLLM's sleep mode sees it.

    Level 0 pauses serving and frees nothing; level 1 frees the KV cache; level 2 also
    drops the weights (re-mapped from GMS on wake, not read from disk again). Wake restores
    the tags asked for (all by default); the engine serves again once nothing is missing.
    """

    held: set[str] = field(default_factory=lambda: set(MEMORY_TAGS))
    level: int | None = None  # set while asleep

    @property
    def sleeping(self) -> bool:
        return self.level is not None

    def sleep(self, level: int) -> list[str]:
        """Go to sleep at `level`; returns the tags to free now (already-free ones skipped)."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {sorted(SLEEP_LEVELS)}, "
                             f"got {level}")
        drop = [tag for tag in SLEEP_LEVELS[level] if tag in self.held]
        self.held.difference_update(drop)
        self.level = level if self.level is None else max(self.level, level)
        return drop

    def wake(self, tags: list[str] | None = None) -> list[str]:
        """Returns the tags to restore now; the engine is awake when none is missing."""
        wanted = tags or list(MEMORY_TAGS)
        unknown = [t for t in wanted if t not in MEMORY_TAGS]
        if unknown:
            raise ValueError(f"unknown wake tag(s) {unknown}; use {list(MEMORY_TAGS)}")
        restore = [t for t in MEMORY_TAGS if t in wanted and t not in self.held]
        self.held.update(restore)
        if self.held == set(MEMORY_TAGS):
            self.level = None
        return restore
