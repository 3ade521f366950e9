"""The sim engine's model: deterministic tokens, KV pages and continuous batching.

Pure logic, no I/O: the HTTP server (`sim_server.py`) drives `Scheduler.step()` and
sleeps for the step time it returns.

With the default vocabulary tokens are bytes in the printable ASCII range, so a
completion's text re-encodes to the exact same tokens: a request resumed elsewhere (prompt
+ text generated so far, sent as a new prompt) continues with exactly the tokens a
failure-free run would have produced. The `bpe` vocabulary (`sim_tokenizer`) does not have
that property, as real tokenizers do not: there a stream resumes exactly only by its ids.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
import struct
from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lumend.engine.costmodel import StepCoefficients
from lumend.engine.sim_tokenizer import (
    ByteVocabulary,
    Ranked,
    Vocabulary,
    context_tail,
    tail_after,
)

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
        block = _block_bytes(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        previous = hashlib.blake2b(previous + block, key=key, digest_size=16).digest()
        out.append(previous)
    return out


def _block_bytes(block: list[int]) -> bytes:
    try:
        return bytes(block)  # one byte per token: the default vocabulary's ids
    except ValueError:
        return array("I", block).tobytes()  # ids past 255 (the bpe vocabulary)


def kv_page(block_hash: bytes, page_bytes: int) -> bytes:
    """The KV page of a block: bytes derived from its chained hash, so a restored page can
    be checked byte by byte against what the engine would have computed."""
    digest = hashlib.blake2b(block_hash, digest_size=64).digest()
    whole, rest = divmod(page_bytes, 64)
    # One allocation of the page (no oversized copy to cut): this runs for every saved block.
    return digest * whole + digest[:rest] if rest else digest * whole


# The step-time formula `a + b*prefill + c*prefill^2 + d*decode_batch + e*decode_context` is
# the cluster simulator's (one class, so the sim engine and `lumenctl sim` cannot drift apart).
StepCost = StepCoefficients


# vLLM 0.32's bounds for its request phase histograms (vllm.v1.metrics.buckets
# .REQUEST_LATENCY_BUCKETS), `vllm:request_prefill_time_seconds` among them.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# ... and for `vllm:time_to_first_token_seconds` (vllm.v1.metrics.loggers).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass
class Histogram:
    """A Prometheus histogram's state: observations per bucket (`counts[i]`: those at most
    `bounds[i]` and above the bound before; the last, those above every bound), sum and
    count."""

    bounds: tuple[float, ...] = REQUEST_LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at most it) per bucket, +inf last: the `_bucket`
        series."""
        return list(zip((*self.bounds, math.inf), itertools.accumulate(self.counts),
                        strict=True))


@dataclass
class StepClock:
    """Paces modelled steps on the wall clock. Each step ends `step_s` after the previous
    one's end, not after the engine's own work between them (committing and streaming
    tokens, saving checkpoint blocks), which would otherwise add to every modelled step.
    A step that starts more than one step's length behind restarts the clock from now
    (no burst of short steps to catch up); the time given up is `late_s`. `idle()` when
    the engine runs out of work: the next step starts when it is asked for.

    `ended(now)` when a step's wait is over: how far past its scheduled end the engine
    got to commit it is `overrun_s` (a busy event loop or CPU wakes it late). Each step's
    tokens go out that late, though the next step still ends on schedule, so an overrun
    under a step is in every TTFT and TPOT and never in `late_s`."""

    end: float | None = None
    modelled_s: float = 0.0  # every step's modelled (time-scaled) seconds
    late_s: float = 0.0  # wall seconds the engine fell behind its model and gave up
    overrun_s: float = 0.0  # wall seconds steps were committed past their scheduled end

    def begin(self, now: float, step_s: float) -> float:
        """Seconds to wait from `now` until the step of `step_s` ends."""
        if self.end is None:
            start = now
        else:
            start = max(self.end, now - step_s)
            self.late_s += max(0.0, now - step_s - self.end)
        self.end = start + step_s
        self.modelled_s += step_s
        return max(0.0, self.end - now)

    def ended(self, now: float) -> None:
        if self.end is not None:
            self.overrun_s += max(0.0, now - self.end)

    def idle(self) -> None:
        self.end = None


class TokenModel:
    """The token function over a vocabulary: greedy picks the best candidate; a sampled
    request draws among the candidates with its temperature; with `eos_every` N > 0 the
    model ends a text with EOS about once per N tokens (never mid-character)."""

    def __init__(self, vocab: Vocabulary | None = None, eos_every: int = 0,
                 tokens_per_chunk: int = 1) -> None:
        if eos_every < 0:
            raise ValueError(f"eos_every must be 0 (never) or more, got {eos_every}")
        if tokens_per_chunk < 1:
            raise ValueError(f"tokens_per_chunk must be at least 1, got {tokens_per_chunk}")
        self.vocab: Vocabulary = vocab or ByteVocabulary()
        self.eos_every = eos_every
        self.tokens_per_chunk = tokens_per_chunk

    def _ends(self, state: int, tail: bytes, ignore_eos: bool) -> bool:
        return (self.eos_every > 0 and not ignore_eos and not tail
                and (state >> 20) % self.eos_every == 0)

    def greedy(self, state: int, tail: bytes, ignore_eos: bool = False) -> int:
        if self._ends(state, tail, ignore_eos):
            return self.vocab.eos_id
        return self.vocab.choose(state, tail)

    def ranked(self, state: int, tail: bytes, ignore_eos: bool = False) -> Ranked:
        ranked = self.vocab.ranked(state, tail)
        if self._ends(state, tail, ignore_eos):
            eos = self.vocab.eos_id
            others = tuple(t for t in ranked.tokens if t != eos)[:len(ranked.tokens) - 1]
            return Ranked((eos, *others), ranked.logprobs)
        return ranked

    def chunk_tokens(self, state: int) -> int:
        """How many tokens a step commits for a request (speculative decoding's accepted
        drafts plus one), 1..tokens_per_chunk, from its context."""
        return 1 + (state >> 33) % self.tokens_per_chunk

    def reference(self, seed: int, prompt: list[int], max_tokens: int) -> list[int]:
        """What any engine with this model and `seed` answers greedily for `prompt`."""
        state, tail = context_state(seed, prompt), context_tail(self.vocab, prompt)
        out: list[int] = []
        for _ in range(max_tokens):
            token = self.greedy(state, tail)
            out.append(token)
            if token == self.vocab.eos_id and self.eos_every:
                break
            state, tail = _advance(state, token), tail_after(self.vocab, tail, token)
        return out


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    rng: random.Random | None = None  # seeded per request, or fresh randomness
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k per generated token (0: the chosen token only)

    def pick(self, ranked: Ranked) -> int:
        """Draw among the candidates from softmax(logprob / temperature)."""
        assert self.rng is not None
        weights = [math.exp((lp - ranked.logprobs[0]) / self.temperature)
                   for lp in ranked.logprobs]
        return self.rng.choices(ranked.tokens, weights)[0]


@dataclass(frozen=True)
class StepOutput:
    """What one step committed for a request: its tokens (one chunk of a stream), each
    position's distribution when logprobs were asked for, and why it finished, if it did."""

    tokens: list[int]
    ranked: list[Ranked] | None = None
    finish_reason: str | None = None  # "length" | "stop"
    stop_token: int | None = None  # the stop_token_ids member that ended it


@dataclass(eq=False)
class SimRequest:
    id: str
    prompt: list[int]
    max_tokens: int
    emit: Callable[[StepOutput | None], None]  # a step's tokens, or None when aborted
    prefilled: int = 0
    output: list[int] = field(default_factory=list)
    state: int = 0
    cancelled: bool = False
    chain: list[bytes] = field(default_factory=list)  # hashes of the full blocks computed
    sampling: Sampling = field(default_factory=Sampling)
    tail: bytes = b""  # the incomplete UTF-8 character the context ends with
    finished: bool = False
    # On the scheduler's timeline (`Scheduler.now_s`): the start of the first step that
    # computed for it, and the interval from there to the end of the step that gave its
    # first token (vLLM's prefill time); None until then.
    scheduled_s: float | None = None
    prefill_s: float | None = None

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

    def __init__(self, seed: int, cost: StepCost, limits: SchedulerLimits,
                 model: TokenModel | None = None) -> None:
        self.seed = seed
        self.model = model or TokenModel()
        self.cost = cost
        self.limits = limits
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.steps = 0
        self.tokens_generated = 0
        self.prefill_tokens = 0  # prompt tokens computed (restored blocks are not)
        self.drafted_tokens = 0  # draft-assist: drafted tokens verified
        self.accepted_tokens = 0  # ... and accepted
        # The timeline prefill times are measured on: the end of the last step, the sum of
        # the steps' durations (`end_step`); the engine's is its paced, time-scaled steps.
        self.now_s = 0.0
        self._step_s = 0.0  # the step in progress: begin_step's duration
        # vLLM's `vllm:request_prefill_time_seconds` (0.32, vllm.v1.metrics.stats): per
        # request, from the start of the first step scheduled for it to the end of the step
        # that gave its first token (every step between counts whole: chunked prefill, a
        # batch shared with other requests), observed when the request finishes (ends by
        # length or stop; an aborted request is not observed, as vLLM's client aborts). A
        # request resumed from a checkpoint counts too, from the step computing the rest of
        # its prompt: its restore precedes its admission, as vLLM's asynchronous KV loads
        # precede scheduling, and its loaded tokens are not in `prefill_tokens`.
        self.prefill_time = Histogram()

    def add(self, request: SimRequest) -> None:
        request.state = context_state(self.seed, request.prompt)
        request.tail = context_tail(self.model.vocab, request.prompt)
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
                if chunk and r.scheduled_s is None:
                    r.scheduled_s = self.now_s  # scheduled: this step computes for it
                r.prefilled += chunk
                budget -= chunk
                prefill_tokens += chunk
                if r.prefilled == len(r.prompt):
                    decoding.append(r)  # the last prefill chunk also yields a token
            else:
                if r.scheduled_s is None:  # nothing to prefill (an empty prompt)
                    r.scheduled_s = self.now_s
                decoding.append(r)
        context = sum(r.context_len for r in decoding)
        self.prefill_tokens += prefill_tokens
        self._step_s = self.cost.step_time(prefill_tokens, len(decoding), context)
        return self._step_s, decoding

    def verify_seconds(self, drafted_tokens: int) -> float:
        """What verifying drafted tokens adds to a step: they are computed like prompt
        tokens (speculative decoding's k extra tokens per request)."""
        return self.cost.b * drafted_tokens

    def end_step(self, decoding: list[SimRequest],
                 drafts: Mapping[str, Sequence[int]] | None = None,
                 step_s: float | None = None) -> None:
        """Commit each request's next tokens: one, or up to the model's tokens per chunk;
        with `drafts` (tokens proposed after a request's context), also every drafted
        token that matches the target's, up to the first that does not: the longest
        matching prefix plus one token of the target's own, as speculative decoding
        verifies them. The output is the same either way; a step's tokens are one
        `StepOutput` (one streamed chunk).

        `step_s`: how long the step took on the timeline prefill times are measured on
        (the engine: its modelled duration, verify included, x the time scale, as paced);
        default: `begin_step`'s duration."""
        self.now_s += self._step_s if step_s is None else step_s
        for r in decoding:
            if r.cancelled:
                continue
            proposal = drafts.get(r.id, ()) if drafts else ()
            # Tokens past max_tokens are never verified (nor counted as drafted).
            proposal = proposal[:max(0, r.max_tokens - len(r.output) - 1)]
            self.drafted_tokens += len(proposal)
            first = not r.output
            self._commit(r, proposal)
            if first and r.scheduled_s is not None:
                r.prefill_s = self.now_s - r.scheduled_s
            if r.finished and r.prefill_s is not None:
                self.prefill_time.observe(r.prefill_s)
        self.running = [r for r in self.running if not r.finished and not r.cancelled]
        self.steps += 1

    def _commit(self, r: SimRequest, proposal: Sequence[int]) -> None:
        vocab, sampling = self.model.vocab, r.sampling
        budget = self.model.chunk_tokens(r.state)
        tokens: list[int] = []
        ranks: list[Ranked] | None = [] if sampling.logprobs is not None else None
        finish: str | None = None
        stop_token: int | None = None
        matched = 0
        while True:
            ranked = None
            if ranks is not None or sampling.temperature > 0:
                ranked = self.model.ranked(r.state, r.tail, sampling.ignore_eos)
            if sampling.temperature > 0:
                assert ranked is not None
                token = sampling.pick(ranked)
            else:
                token = self.model.greedy(r.state, r.tail, sampling.ignore_eos)
            r.state = _advance(r.state, token)
            r.tail = tail_after(vocab, r.tail, token)
            r.output.append(token)
            tokens.append(token)
            if ranks is not None and ranked is not None:
                ranks.append(ranked)
            self.tokens_generated += 1
            if token in sampling.stop_token_ids:
                finish, stop_token = "stop", token
            elif token == vocab.eos_id and not sampling.ignore_eos:
                finish = "stop"
            elif len(r.output) >= r.max_tokens:
                finish = "length"
            if finish is not None:
                break
            if matched < len(proposal) and proposal[matched] == token:
                matched += 1
                continue
            if len(tokens) < budget and not proposal:
                continue
            break
        self.accepted_tokens += matched
        r.finished = finish is not None
        r.emit(StepOutput(tokens, ranks, finish, stop_token))


def reference_completion(seed: int, prompt: list[int], max_tokens: int) -> list[int]:
    """What any sim engine with `seed` and the default vocabulary answers for `prompt`:
    the check for resumed streams (`TokenModel.reference` for the others)."""
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
