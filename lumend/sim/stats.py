"""Statistics over seeds: the mean with a 95% Student-t interval, and paired comparisons.

Every policy comparison in the simulator's docs runs each policy on the same seeds (the same
workload and fault per seed), so two policies are compared per seed (`paired_ratio`): the
spread of the per-seed ratio is much smaller than that of either policy's numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Two-sided 95% Student-t quantiles by degrees of freedom (1..30); above 30, 1.96.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t95(dof: int) -> float:
    if dof < 1:
        raise ValueError(f"need at least 2 values for an interval, got dof {dof}")
    return _T95[dof - 1] if dof <= len(_T95) else 1.96


def interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% interval); half-width 0 for one value."""
    if not values:
        raise ValueError("no values")
    n = len(values)
    m = math.fsum(values) / n
    if n == 1:
        return m, 0.0
    var = math.fsum((v - m) ** 2 for v in values) / (n - 1)
    return m, t95(n - 1) * math.sqrt(var / n)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean over pairs of a_i / b_i with its 95% interval (pairs where b_i is 0 dropped)."""
    if len(a) != len(b):
        raise ValueError(f"unpaired: {len(a)} and {len(b)} values")
    ratios = [x / y for x, y in zip(a, b, strict=True) if y]
    return interval(ratios)
