"""The marginal cost of a prompt token, fitted from an engine's own steps.

vLLM's prefill time is per request, from its first scheduled step to its first token: when
several prompts share steps each counts the steps whole, so under concurrency seconds per
prompt token overstate what one more token costs (six prompts together: about 8x on a sim
engine). A recovery that weighs recomputing a prefix against restoring it, and
draft-assist's verify cost, want the marginal figure: what a step's extra tokens add to it.

Each engine fits it from its steps. A step that ran `extra` tokens beyond one per sequence
(prompt chunks, drafted tokens to verify) for `sequences` sequences took `seconds`; over
many steps, least squares on `seconds = base + per_token * extra + per_sequence *
sequences` gives `per_token`, used once its standard error is under MAX_RELATIVE_ERROR of
it: a precision, so more steps never make a fit undetermined (a spread per step did: an
engine serving long streams after a few prompts lost its fit as decode steps piled up).
The engine keeps the fit's sums as cumulative counters (`FIT_KEYS`, exported as
`lumen_step_fit_<key>_total`); lumend copies them into the worker's record and the
coordinator solves the fit from the sums of its workers (`lumend.coordinator.estimates`).
The sums are plain floats: a month of steps keeps their relative error near 1e-16, far
below what the solve needs.

Where the seconds come from: the sim engine gives each step's modelled (paced) duration;
vLLM's scheduler-side KV connector times the interval between consecutive steps it builds
metadata for (`StepTimer`), counted only when the later step continues a request of the
earlier one (the engine did not idle in between).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

FIT_KEYS = ("n", "p", "b", "y", "pp", "bb", "pb", "py", "by", "yy")
FIT_MEANINGS = {"n": "1 (steps)", "p": "extra tokens", "b": "sequences", "y": "seconds",
                "pp": "extra tokens squared", "bb": "sequences squared",
                "pb": "extra tokens x sequences", "py": "extra tokens x seconds",
                "by": "sequences x seconds", "yy": "seconds squared"}
METRIC_PREFIX = "lumen_step_fit_"
# A fit needs enough steps, and a slope known to MAX_RELATIVE_ERROR (its standard error
# over its value): steps that (almost) all carry the same extra tokens, or too few steps
# with prompt tokens for the timing noise, leave it undetermined.
MIN_FIT_STEPS = 64
MAX_RELATIVE_ERROR = 0.2


@dataclass(slots=True)
class StepFitSums:
    """Sums over steps of 1, extra tokens p, sequences b, seconds y and their products."""

    n: float = 0.0
    p: float = 0.0
    b: float = 0.0
    y: float = 0.0
    pp: float = 0.0
    bb: float = 0.0
    pb: float = 0.0
    py: float = 0.0
    by: float = 0.0
    yy: float = 0.0

    def observe(self, seconds: float, extra_tokens: int, sequences: int) -> None:
        p, b, y = float(extra_tokens), float(sequences), seconds
        self.n += 1.0
        self.p += p
        self.b += b
        self.y += y
        self.pp += p * p
        self.bb += b * b
        self.pb += p * b
        self.py += p * y
        self.by += b * y
        self.yy += y * y

    def values(self) -> tuple[float, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def of(cls, values: Sequence[float]) -> StepFitSums:
        if len(values) != len(FIT_KEYS):
            raise ValueError(f"a step fit has {len(FIT_KEYS)} sums, not {len(values)}")
        return cls(*(float(v) for v in values))

    def __add__(self, other: StepFitSums) -> StepFitSums:
        return StepFitSums(*(a + b for a, b in zip(self.values(), other.values(), strict=True)))

    def __sub__(self, other: StepFitSums) -> StepFitSums:
        return StepFitSums(*(a - b for a, b in zip(self.values(), other.values(), strict=True)))

    def metric_lines(self) -> list[str]:
        return [f"{METRIC_PREFIX}{key}_total {value!r}"
                for key, value in zip(FIT_KEYS, self.values(), strict=True)]


def parse_sums(samples: Mapping[str, float]) -> StepFitSums | None:
    """The sums from metric samples keyed `lumen_step_fit_<key>_total` (summed over
    label sets by the caller); None unless every one is there, finite and not negative."""
    values = []
    for key in FIT_KEYS:
        value = samples.get(f"{METRIC_PREFIX}{key}_total")
        if value is None or not math.isfinite(value) or value < 0:
            return None
        values.append(value)
    return StepFitSums.of(values)


@dataclass(frozen=True, slots=True)
class StepFit:
    base_s: float  # seconds of a step with no sequence and no extra token
    per_token_s: float  # seconds one more extra token adds (the marginal prompt token)
    per_sequence_s: float  # seconds one more decoding sequence adds
    steps: int


def solve(s: StepFitSums) -> StepFit | None:
    """Least squares of y on (1, p, b) from the sums; None with too few steps, a slope of
    p that the steps do not determine to MAX_RELATIVE_ERROR, or one that is not a positive
    number."""
    if s.n < MIN_FIT_STEPS:
        return None
    n = s.n
    # Centred second moments (covariances times n).
    spp = s.pp - s.p * s.p / n
    sbb = s.bb - s.b * s.b / n
    spb = s.pb - s.p * s.b / n
    spy = s.py - s.p * s.y / n
    sby = s.by - s.b * s.y / n
    syy = s.yy - s.y * s.y / n
    two = sbb > 1e-9 * max(1.0, s.bb)  # else the same sequences in every step: p alone
    det = spp * sbb - spb * spb
    residual_pp = det / sbb if two else spp  # p's spread that b does not explain, times n
    if not residual_pp > 1e-9 * max(1.0, s.pp):
        return None
    if two:
        per_token = (spy * sbb - sby * spb) / det
        per_sequence = (sby * spp - spy * spb) / det
    else:
        per_token, per_sequence = spy / spp, 0.0
    if not math.isfinite(per_token) or per_token <= 0:
        return None
    # The slope's standard error: the residual variance over p's unexplained spread.
    residual = max(0.0, syy - per_token * spy - per_sequence * sby)
    free = n - (3 if two else 2)
    if math.sqrt(residual / free / residual_pp) > MAX_RELATIVE_ERROR * per_token:
        return None
    base = (s.y - per_token * s.p - per_sequence * s.b) / n
    return StepFit(base, per_token, per_sequence, int(n))


class StepTimer:
    """Times an engine's steps from the moments they are scheduled: a step's seconds are
    the interval to the next one, counted when that next step continues a request of this
    one (so the engine ran without idling between them)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.sums = StepFitSums()
        self._clock = clock
        self._last: tuple[float, int, int, frozenset[str]] | None = None

    def scheduled(self, tokens: Mapping[str, int]) -> None:
        """A step was scheduled with `tokens[request]` tokens for each request in it."""
        now = self._clock()
        if self._last is not None:
            at, extra, sequences, requests = self._last
            if not requests.isdisjoint(tokens):
                self.sums.observe(now - at, extra, sequences)
        sequences = len(tokens)
        extra = sum(tokens.values()) - sequences
        self._last = (now, extra, sequences, frozenset(tokens)) if tokens else None
