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


SUMMARY_KEYS = ("mean_ttft_s", "mean_tpot_s", "recovery_time_s", "baseline_mean_ttft_s",
                "uninterrupted_mean_ttft_s", "replay_ttft_mean_s")
COMPARED_KEYS = ("mean_ttft_s", "mean_tpot_s", "recovery_time_s", "baseline_mean_ttft_s")


def over_seeds(per_seed: dict[str, list[dict[str, object]]], seeds: list[int]
               ) -> dict[str, object]:
    """Policies' metric documents (one list per policy, one entry per seed, same order) as
    means with 95% intervals, and LUMEN's paired ratios against every other policy.

    A metric that is null in some seed (e.g. never recovered) is summarised over the seeds
    where it is a number; `missing` counts the others."""
    policies = []
    for name, docs in per_seed.items():
        row: dict[str, object] = {"policy": name}
        for key in SUMMARY_KEYS:
            values = [v for d in docs if isinstance(v := d.get(key), (int, float))]
            if values:
                m, half = interval([float(v) for v in values])
                row[key] = {"mean": m, "ci95": half, "missing": len(docs) - len(values)}
            else:
                row[key] = None
        policies.append(row)
    comparisons = []
    if "lumen" in per_seed:
        for other, docs in per_seed.items():
            if other == "lumen":
                continue
            entry: dict[str, object] = {"policy": "lumen", "versus": other}
            for key in COMPARED_KEYS:
                pairs = [(float(x), float(y)) for a, b in zip(per_seed["lumen"], docs,
                                                              strict=True)
                         if isinstance(x := a.get(key), (int, float))
                         and isinstance(y := b.get(key), (int, float)) and y]
                if pairs:
                    m, half = paired_ratio([x for x, _ in pairs], [y for _, y in pairs])
                    entry[key.removesuffix("_s") + "_ratio"] = {"mean": m, "ci95": half,
                                                                "pairs": len(pairs)}
                else:
                    entry[key.removesuffix("_s") + "_ratio"] = None
            comparisons.append(entry)
    return {"seeds": seeds, "policies": policies, "comparisons": comparisons}
