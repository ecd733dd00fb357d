"""Medians over benchmark rounds and their distribution-free confidence intervals (order statistics)."""

from __future__ import annotations

import statistics
from math import comb


def median_ci(values, level: float = 0.95) -> tuple[float, float, float]:
    """(low, high, coverage): the narrowest order-statistic interval [x_(j), x_(n+1-j)] holding the median.

    For independent rounds from any continuous distribution, the number of rounds below the true
    median is Binomial(n, 1/2), so [x_(j), x_(n+1-j)] (sorted, 1-based) covers it with probability
    1 - 2 P(B <= j - 1) whatever the distribution: no normality assumed, nothing resampled. j is the
    largest with coverage >= `level`. Fewer than 6 rounds cannot reach 95 %: the interval is then
    the rounds' min-max and `coverage` says what it is (2 rounds 50 %, 3 75 %, 4 87.5 %, 5 93.75 %).
    One value: (x, x, 0.0).
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_ci of no values")
    def coverage(j: int) -> float:  # of [x_(j), x_(n+1-j)]: 1 - 2 P(B <= j - 1), B ~ Binomial(n, 1/2)
        return 1 - 2 * sum(comb(n, i) for i in range(j)) / 2 ** n

    j = 1
    while j < (n + 1) // 2 and coverage(j + 1) >= level:  # narrower, never past the median itself
        j += 1
    return xs[j - 1], xs[n - j], coverage(j)


def summary(values) -> dict:
    """{median, ci: [low, high], coverage} of `values` (median_ci's interval)."""
    low, high, coverage = median_ci(values)
    return dict(median=statistics.median(values), ci=[low, high], coverage=coverage)


def coverage_text(n: int, level: float = 0.95) -> str:
    """How to read an interval over n rounds: 'a 96.88 % CI' (6), 'a 75 % CI (95 % needs >= 6 rounds)' (3)."""
    need = next(m for m in range(1, 64) if median_ci(range(m), level)[2] >= level)
    coverage = median_ci(range(n), level)[2]
    if n == 1:
        return f"no CI (one round; {100 * level:g} % needs >= {need} rounds)"
    pct = f"{100 * coverage:.4g} %"
    return f"a {pct} CI" if coverage >= level else f"a {pct} CI ({100 * level:g} % needs >= {need} rounds)"
