"""p3's online credit: the schedule of trials, which intervals count, the rule that keeps one, and the simulator's."""

from __future__ import annotations

import pytest

from runtime.p3.online_credit import CANDIDATES, CreditTrials, fastest
from runtime.sim import simulate
from runtime.sim.dataparallel import Run
from runtime.sim.p3 import p3_settings
from test_sim import fast_net, toy


def test_the_schedule_warms_up_then_tries_each_credit_in_blocks_the_order_reversed_each_round():
    t = CreditTrials(16, candidates=(2, 4, 8, 16), warmup=2, hold=3, rounds=2)
    assert t.order == [16, 2, 4, 8]  # the start credit first: ties keep it
    assert t.schedule == [16] * 2 + [16] * 3 + [2] * 3 + [4] * 3 + [8] * 3 + [8] * 3 + [4] * 3 + [2] * 3 + [16] * 3
    assert [t.credit_for(k) for k in range(len(t.schedule))] == t.schedule
    assert t.credit_for(len(t.schedule)) == 16  # the decision may not be in on every rank yet: the start credit
    with pytest.raises(RuntimeError, match="never came"):
        t.credit_for(len(t.schedule) + 1)


def test_only_intervals_inside_one_block_count_and_the_fastest_median_is_kept_from_then_on():
    t = CreditTrials(8, candidates=(2, 4, 8), warmup=1, hold=3, rounds=2)
    speed = {2: 1.3, 4: 0.9, 8: 1.0}
    for k in range(1, len(t.schedule)):
        # An interval straddling two blocks (or the warm-up) would mix credits: it reads absurdly slow here.
        straddles = k - 1 < t.warmup or (k - 1 - t.warmup) // t.hold != (k - t.warmup) // t.hold
        t.observe(k, 100.0 if straddles else speed[t.schedule[k]])
    assert {c: len(v) for c, v in t.figures.items()} == {8: 4, 2: 4, 4: 4}  # hold - 1 a block, 2 rounds
    assert all(v == [speed[c]] * 4 for c, v in t.figures.items())
    assert t.chosen == 4 and t.credit_for(len(t.schedule) + 1) == 4 and t.credit_for(10 ** 6) == 4
    assert "chose 4" in t.describe() and "4 0.9 s" in t.describe()
    t.observe(len(t.schedule) + 5, 0.1)  # figures after the decision change nothing
    assert t.chosen == 4


def test_without_a_single_figure_the_start_credit_stays():
    t = CreditTrials(4, candidates=(2, 8), warmup=1, hold=2, rounds=1)
    for k in range(1, len(t.schedule)):
        t.observe(k, 0.0)
    assert t.chosen == 4 and t.credit_for(len(t.schedule) + 1) == 4


def test_a_credit_must_beat_the_earlier_ones_by_more_than_the_tie_to_be_kept():
    assert fastest({16: [1.0, 1.0], 2: [0.995, 0.995]}, [16, 2]) == 16  # 0.5 % faster: noise, the start stays
    assert fastest({16: [1.0, 1.0], 2: [0.98, 0.97]}, [16, 2]) == 2
    assert fastest({16: [1.0, 5.0, 1.1], 2: [1.2, 1.2, 1.2]}, [16, 2]) == 16  # medians, not means
    assert fastest({16: [], 2: [1.0]}, [16, 2]) == 2
    with pytest.raises(ValueError, match="no step time"):
        fastest({16: []}, [16])


@pytest.mark.parametrize("kwargs", [{"start": 0}, {"start": "auto"}, {"start": 4, "hold": 1},
                                    {"start": 4, "rounds": 0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        CreditTrials(**kwargs)


def test_the_candidates_include_the_start_credit_once():
    t = CreditTrials(5)
    assert t.order == [5, *CANDIDATES] and len(set(CreditTrials(4).order)) == len(CANDIDATES)


def test_the_simulator_keeps_the_credit_the_runtimes_rule_keeps():
    profile, cluster = toy(n=8, fwd=0.002, bwd=0.004), fast_net(4, rpn=2, device="gpu")
    online = simulate(profile, cluster, "p3@auto/online")
    tried = {int(c): s for c, s in online.details["credit_tried"].items()}
    start = p3_settings(Run(profile, cluster), "auto", "online")
    assert start.online and list(tried) == CreditTrials(start.credit).order
    assert tried == {c: simulate(profile, cluster, "p3", credit=c).t_iter_s for c in tried}
    best = fastest({c: [s] for c, s in tried.items()}, list(tried))
    assert online.details["credit_chosen"] == best and online.t_iter_s == tried[best]
    assert f"chose {best}" in online.details["p3"]
