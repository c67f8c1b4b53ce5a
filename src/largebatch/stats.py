"""The interval every report states: the 95% confidence interval of a mean over a few seeds.

For n values with mean x and sample standard deviation s (n - 1 in the denominator), the interval
is x -/+ t(0.975, n - 1) * s / sqrt(n), Student's t with n - 1 degrees of freedom. Applied to paired
differences (arm minus baseline at the same seed) it is the paired t interval: a comparison is
called a difference only when the interval excludes 0.
"""

from __future__ import annotations

import math
import statistics

# Student t 0.975 quantiles by degrees of freedom (1-9): the 95% interval of a mean over 2-10 seeds
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def ci95(values: list[float]) -> tuple[float, float] | None:
    """95% confidence interval of the mean of ``values`` (None below two values)."""
    if len(values) < 2:
        return None
    if len(values) - 1 not in T_975:
        raise ValueError(f"{len(values)} values: intervals are tabulated for 2 to {max(T_975) + 1}")
    mean = statistics.fmean(values)
    half = T_975[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))
    return mean - half, mean + half
