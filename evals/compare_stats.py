"""Statistics over seeds for `stapo compare`: mean with a 95% t interval, and paired differences.

One seed of an RL run is one draw: two runs of the same method that differ only in the seed can end
several points apart, so a method is judged by its runs over seeds. For each group of runs (one
method, several seeds) compare reports the mean and the 95% **t interval** over seeds,
``mean +- t(0.975, n-1) * sd / sqrt(n)`` (sd with n-1 in the denominator), and for every other
group the **paired** per-seed difference against the first group: runs with the same seed share
the data order and the initial sampling, so the difference of a pair removes what the seed alone
does. The interval of the mean difference is the same t interval over the n pair differences, and
the count of pairs where the group is higher says how consistent the difference is.

The t quantiles come from a table (no SciPy): exact to 3 decimals for 1-30 degrees of freedom,
then the 40 / 60 / 120 rows and the normal 1.960 beyond, each rounded up to the next tabulated
row (a slightly wider interval, never a narrower one).

    mean_interval([0.5, 0.6, 0.7])   # {"mean": 0.6, "low": 0.3516, "high": 0.8484, "n": 3, "sd": 0.1}
    paired_difference({0: 0.5, 1: 0.6}, {0: 0.55, 1: 0.58})   # other - base over shared seeds
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

__all__ = ["T975", "t975", "mean_interval", "paired_difference", "INTERVAL_NOTE"]

T975: dict[int, float] = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
    20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
    29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980,
}
"""Two-sided 95% quantiles of Student's t, t(0.975, df), from the standard table."""

INTERVAL_NOTE = ("95% t interval over seeds: mean +- t(0.975, n-1) x sd / sqrt(n), cut to the metric's range "
                 "(0 and up for times, lengths, entropies and norms; 0-100 for %); paired differences pair "
                 "runs by seed (same data order and initial sampling)")


def t975(df: int) -> float:
    """t(0.975, df) for df >= 1: the table's value, or the next smaller tabulated df's (wider) past 30."""
    if df < 1:
        raise ValueError(f"t975: degrees of freedom must be >= 1, got {df}")
    if df in T975:
        return T975[df]
    if df > 120:
        return 1.960
    return T975[max(k for k in T975 if k <= df)]


def mean_interval(xs: Sequence[float]) -> dict[str, Any]:
    """Mean, sample sd and the 95% t interval of ``xs``; with one value the interval and sd are None."""
    n = len(xs)
    if n == 0:
        return {"mean": None, "low": None, "high": None, "n": 0, "sd": None}
    mean = sum(xs) / n
    if n == 1:
        return {"mean": mean, "low": None, "high": None, "n": 1, "sd": None}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n, "sd": sd}


def paired_difference(base: Mapping[Hashable, float], other: Mapping[Hashable, float]) -> dict[str, Any]:
    """``other - base`` for every seed both have: mean and 95% t interval of the differences, how
    many pairs are higher / lower / equal, and the per-seed differences (seed -> difference)."""
    seeds = [s for s in other if s in base]
    diffs = {s: other[s] - base[s] for s in seeds}
    out = mean_interval(list(diffs.values()))
    out.update({
        "n_higher": sum(1 for d in diffs.values() if d > 0),
        "n_lower": sum(1 for d in diffs.values() if d < 0),
        "n_equal": sum(1 for d in diffs.values() if d == 0),
        "diffs": {str(s): d for s, d in diffs.items()},
    })
    return out
