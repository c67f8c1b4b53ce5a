"""The interval every report states: the 95% confidence interval of a mean over a few seeds.

For n values with mean x and sample standard deviation s (n - 1 in the denominator), the interval
is x -/+ t(0.975, n - 1) * s / sqrt(n), Student's t with n - 1 degrees of freedom. Applied to paired
differences (arm minus baseline at the same seed) it is the paired t interval: a comparison is
called a difference only when the interval excludes 0. Values that are all the same (sd 0:
deterministic runs, or a count that moved by the same amount at every seed) have a zero-width
interval, which would exclude 0 for any gap but 0: no report calls a difference on one
(``all_same``).
"""

from __future__ import annotations

import math
import statistics

# Student t 0.975 quantiles by degrees of freedom (1-9): the 95% interval of a mean over 2-10 seeds,
# to 10 decimals (at 3, an interval's end could round the other way in a report's 4th decimal)
T_975 = {1: 12.7062047362, 2: 4.3026527297, 3: 3.1824463053, 4: 2.7764451052, 5: 2.5705818356,
         6: 2.4469118511, 7: 2.3646242516, 8: 2.3060041352, 9: 2.2621571628}

SAME_GAP = 1e-12
"""Paired gaps closer than this are one value: losses and accuracies that really differ differ by far
more, while the same count difference at two seeds can differ in the last bits (4/14 - 5/14 !=
5/14 - 6/14 in float64)."""


def all_same(values: list[float]) -> bool:
    """True for two or more values within SAME_GAP of each other (a zero-width interval)."""
    return len(values) >= 2 and max(values) - min(values) <= SAME_GAP


def ci95(values: list[float]) -> tuple[float, float] | None:
    """95% confidence interval of the mean of ``values`` (None below two values)."""
    if len(values) < 2:
        return None
    if len(values) - 1 not in T_975:
        raise ValueError(f"{len(values)} values: intervals are tabulated for 2 to {max(T_975) + 1}")
    mean = statistics.fmean(values)
    half = T_975[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))
    return mean - half, mean + half
