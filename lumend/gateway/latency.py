"""Latency histograms the gateway keeps (bucket counts, never the samples themselves) and
Prometheus reads on each scrape."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import HistogramMetricFamily

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
class ByModel:
    """One histogram per served model: the `model_name` label, as vLLM's own latency
    metrics have it. The model is the served model the request ran on (the worker's
    `model`), never a name a client made up: only requests that produced a token are
    observed, so the label's values are the cluster's models."""

    bounds: tuple[float, ...] = TOKEN_BUCKETS
    models: dict[str, Buckets] = field(default_factory=dict)

    def observe(self, seconds: float, model: str) -> None:
        buckets = self.models.get(model)
        if buckets is None:
            buckets = self.models[model] = Buckets(self.bounds)
        buckets.observe(seconds)

    @property
    def count(self) -> int:
        """Observations of every model."""
        return sum(b.count for b in self.models.values())

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus `le` buckets of every model together (what `sum by (le)` reads)."""
        total = Buckets(self.bounds)
        for b in self.models.values():
            total.counts = [x + y for x, y in zip(total.counts, b.counts, strict=True)]
            total.total += b.total
        return total.cumulative()


LATENCIES = (
    ("ttft", "From a request's arrival to its first token sent, by served model."),
    ("tpot", "Mean time between a request's tokens (per request), by served model."),
    ("recovery", "From an upstream breaking mid-stream to the next token sent to the client "
     "(resume or recompute included), by served model."),
)


@dataclass
class StreamLatency:
    """Per-request latency seen by clients of this gateway, by served model."""

    ttft: ByModel = field(default_factory=ByModel)  # request in -> first token out
    tpot: ByModel = field(default_factory=ByModel)  # mean time between a request's tokens
    recovery: ByModel = field(default_factory=ByModel)  # upstream broke -> next token out

    def families(self) -> Iterator[HistogramMetricFamily]:
        """lumen_gateway_{ttft,tpot,recovery}_seconds with a `model_name` label. The names
        are those of 0.1 (which had no label): queries that `sum by (le)` read the same
        series as before; `sum by (le, model_name)` splits them by model."""
        for name, what in LATENCIES:
            by_model: ByModel = getattr(self, name)
            family = HistogramMetricFamily(f"lumen_gateway_{name}_seconds", what,
                                           labels=["model_name"])
            for model, buckets in sorted(by_model.models.items()):
                family.add_metric([model], buckets.cumulative(), sum_value=buckets.total)
            yield family
