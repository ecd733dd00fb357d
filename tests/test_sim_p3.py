"""p3 in the simulator: its slices in flight as the runtime's per-rank credit keeps them."""

from __future__ import annotations

from runtime.sim import simulate
from runtime.sim.engine import Engine
from test_sim import fast_net, toy


def test_p3_keeps_credit_slices_in_flight_per_rank_so_an_aggregating_node_keeps_l_times_that(monkeypatch):
    """runtime.p3's credit bounds each rank's outgoing messages. Aggregated, a slice's traffic across the link is
    its aggregator's (local rank s % L): the node's L ranks keep L x credit slices on its link. Flat, where one
    host stands for all (compute on the cores; on a device every rank is simulated, test_sim_p3_owners), a
    simulated slice is one of every rank of the host: credit of them."""
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
        simulate(p, fast_net(2, rpn=rpn, device="gpu" if aggregate and rpn > 1 else "cpu"), "p3", slice_size=4096,
                 credit=2, node_aggregation=aggregate)
        assert peak[0] == expect, (aggregate, rpn, peak[0])


def test_p3_yield_starts_no_slice_from_the_steps_agreement_until_the_buffers_average(monkeypatch):
    """runtime.p3's hold (P3Options.yield_link, p3-yield): where module buffers are averaged after each step, no
    slice starts between the step's agreement starting and that average being done; it holds once a step. Without
    buffers, or as p3 by default, it never holds."""
    from dataclasses import replace

    from runtime.sim import p3 as sim_p3
    from runtime.sim.simulate import STEPS

    schedules, starts, releases = [], [], []
    init, start, release = sim_p3.P3Schedule.__init__, Engine.start, sim_p3.P3Schedule._release

    def made(self, *args, **kwargs):
        init(self, *args, **kwargs)
        schedules.append(self)

    def counted(engine, activity):
        if activity.name.startswith("slice"):
            starts.append(schedules[-1]._holding)
        return start(engine, activity)

    monkeypatch.setattr(sim_p3.P3Schedule, "__init__", made)
    monkeypatch.setattr(sim_p3.P3Schedule, "_release", lambda self: (releases.append(1), release(self)))
    monkeypatch.setattr(Engine, "start", counted)
    buffered = replace(toy(n=4, params=1_000_000), buffer_elements=50_000, watched_buffers=1)  # not carried
    carried = replace(buffered, watched_buffers=0)
    for profile, name, holds in ((buffered, "p3-yield", True), (buffered, "p3", False), (toy(n=4), "p3-yield", False),
                                 (carried, "p3-yield", False)):
        starts.clear(), releases.clear()
        simulate(profile, fast_net(4, latency=50e-6, device="cpu"), name)  # one host for all: slices by name
        assert starts and not any(starts), (name, "a slice started while holding")
        assert len(releases) == (STEPS if holds else 0), (name, len(releases))  # once a step


def test_p3_carries_the_buffers_as_one_slice_a_step_ahead_of_the_gradients(monkeypatch):
    """runtime.p3 averages the module buffers' vector in its own exchange (none of them only watched): one
    round trip of it a step, and the next forward waits neither for the step's agreement nor for MPI's allreduce
    of the buffers queued behind the exchange, so the step is no longer than with the allreduce."""
    from dataclasses import replace

    from runtime.sim.simulate import STEPS

    names = []
    start = Engine.start

    def counted(engine, activity):
        names.append(activity.name)
        return start(engine, activity)

    monkeypatch.setattr(Engine, "start", counted)
    carried = replace(toy(n=4, params=1_000_000), buffer_elements=200_000)
    watched = replace(carried, watched_buffers=1)
    net = fast_net(4, latency=50e-6, device="cpu")  # one host for all: the vector's round trip is one transfer
    t_carried = simulate(carried, net, "p3").t_iter_s
    trips = names.count("module buffers")
    names.clear()
    t_watched = simulate(watched, net, "p3").t_iter_s
    assert trips == STEPS, trips
    assert names.count("module buffers") > STEPS  # Rabenseifner's steps, one transfer each
    assert t_carried <= t_watched, (t_carried, t_watched)
