"""Latency histograms the gateway keeps (bucket counts, never the samples themselves) and
Prometheus reads on each scrape."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DECISION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 15.0)


@dataclass
class Buckets:
    bounds: tuple[float, ...] = TOKEN_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bound, plus one for +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus `le` buckets: (upper bound, observations at or below it)."""
        out, running = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


@dataclass
class StreamLatency:
    """Per-request latency seen by clients of this gateway."""

    ttft: Buckets = field(default_factory=Buckets)  # request in -> first token out
    tpot: Buckets = field(default_factory=Buckets)  # mean time between a request's tokens
    recovery: Buckets = field(default_factory=Buckets)  # upstream broke -> next token out
