"""Draft-assist rounds (Algorithm 3): how many drafted tokens the target accepts.

One round per decoding sequence per verify step: the drafter proposes k tokens, the target
keeps the longest prefix that agrees with its own next tokens and adds one token of its own.
The draft function here agrees with the target on each token with probability `agreement`,
given that the tokens before it agreed (the usual speculative-decoding model).

The engine advances an assisted worker's decode at `tokens_per_round` (its batch moves as
one, like every decode run) and samples the rounds it actually ran, per step, with
`accepted`: the measured acceptance (accepted / drafted tokens) comes from those samples.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Below this many expected successes a binomial is drawn exactly (geometric skips); above it
# the normal approximation is within a fraction of a token per draw.
EXACT_BELOW = 10.0


def binomial(rng: random.Random, n: int, p: float) -> int:
    """A Binomial(n, p) draw in O(1 + n*min(p, 1-p)) (Python 3.11 has no binomialvariate)."""
    if n <= 0 or p <= 0.0:
        return 0
    if p >= 1.0:
        return n
    if p > 0.5:
        return n - binomial(rng, n, 1.0 - p)
    if n * p < EXACT_BELOW:
        # Skip over the failures: the gap to the next success is geometric.
        log_q = math.log1p(-p)
        hits, pos = 0, 0
        while True:
            pos += int(math.log(1.0 - rng.random()) / log_q) + 1
            if pos > n:
                return hits
            hits += 1
    draw = round(rng.gauss(n * p, math.sqrt(n * p * (1.0 - p))))
    return min(n, max(0, draw))


@dataclass(frozen=True, slots=True)
class DraftFunction:
    agreement: float  # P(a drafted token is the target's | the drafted tokens before it were)
    k: int            # tokens drafted per round

    def tokens_per_round(self) -> float:
        """Expected tokens the target emits per round: 1 + sum of agreement^i, i = 1..k."""
        return math.fsum(self.agreement ** i for i in range(self.k + 1))

    def accepted(self, rng: random.Random, rounds: int) -> int:
        """Drafted tokens accepted over `rounds` independent rounds: the rounds whose first
        i drafted tokens all agree are a binomial thinning of those whose first i-1 did."""
        reach, total = rounds, 0
        for _ in range(self.k):
            reach = binomial(rng, reach, self.agreement)
            if not reach:
                break
            total += reach
        return total
