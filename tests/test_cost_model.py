"""The auto choice's cost model on its own: near ties with Rabenseifner go to the ring, clear wins do not."""

from __future__ import annotations

from mpicomm.algorithms import RING_MARGIN, CostModel, Layout

GBIT = CostModel(beta_cross=8e-9)  # a 1 Gbit/s link


def test_the_ring_takes_a_near_tie_with_rabenseifner():
    """4 hosts x 1 at 1 Gbit/s: the two move the same bytes and differ by two latencies, under the margin from
    1 MiB up; there the ring measured faster (benchmarks/claims.md, fourteenth pass)."""
    four = Layout(4, 4, 1)
    for n in (1 << 20, 8 << 20, 32 << 20):
        ring, rab = GBIT.ring(n, four), GBIT.rabenseifner(n, four)
        assert rab < ring <= rab * (1 + RING_MARGIN), n  # a near tie that the plain minimum gave to Rabenseifner
        assert GBIT.best(n, four) == "ring"


def test_rabenseifner_keeps_what_its_fewer_steps_win():
    assert GBIT.best(256 << 10, Layout(4, 4, 1)) == "rabenseifner"  # two latencies are 4 % of this one
    assert GBIT.best(8 << 20, Layout(128, 128, 1)) == "rabenseifner"  # 254 steps against 14
    assert GBIT.best(4 << 10, Layout(4, 4, 1)) == "doubling"


def test_the_hierarchys_cross_step_follows_the_same_rule():
    two_level = Layout(8, 4, 2)
    times = GBIT._cross(32 << 20, 4)
    assert times["rabenseifner"] < times["ring"] <= times["rabenseifner"] * (1 + RING_MARGIN)
    assert GBIT.cross_algorithm(32 << 20, two_level) == "ring"
    assert GBIT.cross_algorithm(64 << 10, two_level) != "ring"
