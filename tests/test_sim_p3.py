"""p3 in the simulator: its slices in flight as the runtime's per-rank credit keeps them."""

from __future__ import annotations

from runtime.sim import simulate
from runtime.sim.engine import Engine
from test_sim import fast_net, toy


def test_p3_keeps_credit_slices_in_flight_per_rank_so_an_aggregating_node_keeps_l_times_that(monkeypatch):
    """runtime.p3's credit bounds each rank's outgoing messages. Aggregated, a slice's traffic across the link is
    its aggregator's (local rank s % L): the node's L ranks keep L x credit slices on its link. Flat, a simulated
    slice is one of every rank of the host: credit of them."""
    running, peak = [0], [0]
    start = Engine.start

    def counted(engine, activity):
        done = start(engine, activity)
        if activity.name.startswith("slice"):
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            done.then(lambda _: running.__setitem__(0, running[0] - 1))
        return done

    monkeypatch.setattr(Engine, "start", counted)
    p = toy(n=4, params=1_000_000)
    for aggregate, rpn, expect in ((True, 4, 8), (False, 4, 2), (True, 1, 2)):
        peak[0] = 0
        simulate(p, fast_net(2, rpn=rpn), "p3", slice_size=4096, credit=2, node_aggregation=aggregate)
        assert peak[0] == expect, (aggregate, rpn, peak[0])
