"""vLLM's inter-token latency histogram, read from /metrics: how long requests waited
between two tokens (measured at vLLM's API server, so a client's own lag does not count).
Shared by the stall tests and bench/checkpoint_vllm.py."""

from __future__ import annotations

import itertools
import urllib.request


def inter_token_gaps(url: str) -> dict[float, float]:
    """Lower edge of each bucket (s) -> gaps in it, summed over the engine's requests."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    at_most: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:inter_token_latency_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            edge = float("inf") if bound == "+Inf" else float(bound)
            at_most[edge] = at_most.get(edge, 0.0) + float(line.rsplit(" ", 1)[1])
    edges = [0.0, *sorted(at_most)]
    return {low: at_most[high] - at_most.get(low, 0.0)
            for low, high in itertools.pairwise(edges)}


def longest_gap_since(url: str, before: dict[float, float]) -> float:
    """The lower edge of the highest bucket that gained a gap since `before` (s): some
    request waited at least this long between two tokens."""
    gained = {low: n - before.get(low, 0.0) for low, n in inter_token_gaps(url).items()}
    return max((low for low, n in gained.items() if n > 0), default=0.0)
