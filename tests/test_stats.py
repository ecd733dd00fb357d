"""jobs.common.stats: the median's order-statistic CI covers what it says, for any distribution; few rounds say so."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from jobs.common.stats import coverage_text, median_ci, summary


def binomial_coverage(n: int, j: int) -> float:
    """P(j <= B <= n - j), B ~ Binomial(n, 1/2): the rounds below the median leave [x_(j), x_(n+1-j)] around it."""
    return sum(math.comb(n, i) for i in range(j, n - j + 1)) / 2 ** n


@pytest.mark.parametrize("n", [2, 3, 5, 6, 9, 10, 20])
def test_interval_is_the_narrowest_order_statistic_pair_reaching_95_percent(n):
    xs = [10.0 * i for i in range(n)]
    random.Random(n).shuffle(xs)  # the helper sorts
    low, high, coverage = median_ci(xs)
    j = int(low / 10) + 1  # 1-based rank of the lower bound
    assert high == 10.0 * (n - j) and coverage == pytest.approx(binomial_coverage(n, j))
    if n < 6:  # 95 % is out of reach: the whole range, and its true (lower) coverage
        assert (low, high) == (min(xs), max(xs)) and coverage == 1 - 2 / 2 ** n < 0.95
    else:
        assert coverage >= 0.95 and binomial_coverage(n, j + 1) < 0.95


def test_coverage_holds_on_a_skewed_distribution():
    """Exponential rounds (a long tail, like a busy machine's): 9 rounds cover the true median ~96 % of the time."""
    rng = random.Random(0)
    trials, true_median = 2000, math.log(2)
    hits = 0
    for _ in range(trials):
        low, high, coverage = median_ci([rng.expovariate(1.0) for _ in range(9)])
        hits += low <= true_median <= high
    assert coverage == pytest.approx(0.9609375) and abs(hits / trials - coverage) < 0.02


def test_summary_and_the_words_for_few_rounds():
    assert summary([3.0, 1.0, 2.0]) == dict(median=2.0, ci=[1.0, 3.0], coverage=0.75)
    assert summary([4.0]) == dict(median=4.0, ci=[4.0, 4.0], coverage=0.0)
    assert summary([1.0, 2.0, 4.0, 8.0])["median"] == statistics.median([1.0, 2.0, 4.0, 8.0]) == 3.0
    assert coverage_text(3) == "a 75 % CI (95 % needs >= 6 rounds)"
    assert coverage_text(1) == "no CI (one round; 95 % needs >= 6 rounds)"
    assert coverage_text(9) == "a 96.09 % CI"
    with pytest.raises(ValueError):
        median_ci([])
