"""jobs.bench.collectives' interleaving of the contenders and its judgement of auto against the fastest algorithm."""

from __future__ import annotations

import itertools

import pytest

from jobs.bench.collectives import round_order
from jobs.bench.collectives_report import auto_against_fastest


@pytest.mark.parametrize("n", [2, 3, 5])
def test_each_contender_runs_at_every_position_and_after_both_neighbours(n):
    items = [f"c{i}" for i in range(n)]
    orders = [round_order(items, r) for r in range(2 * n)]
    assert all(sorted(o) == items for o in orders)
    for item in items:
        assert {o.index(item) for o in orders} == set(range(n))
    before = {(o[i - 1], o[i]) for o in orders for i in range(1, n)}
    for a, b in itertools.pairwise(items):  # neighbours in the list: each runs right before the other
        assert (a, b) in before and (b, a) in before


def rows(times: dict) -> list:
    return [dict(op="allreduce", impl=impl, bytes=4096, time_s=sorted(t)[len(t) // 2], round_times_s=t,
                 **({"path": "doubling"} if impl == "auto" else {})) for impl, t in times.items()]


def test_auto_is_paired_round_by_round_with_the_fastest_algorithm():
    """Load that drifts across rounds moves both rows alike: the paired ratios stay near 1 where the medians'
    ratio does not decide it."""
    ring = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    got = auto_against_fastest(rows({"ring-only": ring, "doubling": [0.9 * t for t in ring],
                                     "auto": [0.91 * t for t in ring]}))[4096]
    assert got["fastest"] == "doubling" and got["auto_took"] == "doubling"
    assert got["auto"]["median"] == pytest.approx(0.91 / 0.9) and got["auto"]["ci"][1] == pytest.approx(0.91 / 0.9)
    assert got["auto"]["within"] == "yes" and got["auto"]["coverage"] >= 0.95
    assert got["choice"] == dict(median=1.0, ci=[1.0, 1.0], coverage=got["auto"]["coverage"], within="yes")


def test_a_choice_other_than_the_fastest_is_judged_by_its_own_row():
    ring = [1.0] * 7
    got = auto_against_fastest(rows({"ring-only": ring, "doubling": [1.3] * 7, "auto": [1.01] * 7}))[4096]
    assert got["fastest"] == "ring" and got["auto"]["within"] == "yes"  # auto's own row: as fast as the ring
    assert got["choice"]["median"] == pytest.approx(1.3) and got["choice"]["within"] == "no"  # its choice: slower


@pytest.mark.parametrize("auto, within", [([1.2] * 7, "no"), ([1.0, 1.2, 1.0, 1.2, 1.0, 1.2, 1.0], "undecided")])
def test_auto_slower_in_every_round_is_a_miss_and_a_spread_is_undecided(auto, within):
    got = auto_against_fastest(rows({"doubling": [1.0] * 7, "auto": auto}))[4096]
    assert got["auto"]["within"] == within
