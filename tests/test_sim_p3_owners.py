"""p3's flat exchange simulated rank by rank: slices converge on their owners, credit as mpicomm.sliced_ps keeps it."""

from __future__ import annotations

import collections
import math

import pytest

from runtime.sim import simulate
from runtime.sim.dataparallel import Run
from runtime.sim.engine import Engine
from runtime.sim.p3_owners import OwnerExchange
from test_sim import fast_net, toy


def _exchange(cluster, credit):
    run = Run(toy(n=2), cluster)
    done = {}
    ex = OwnerExchange(run, credit, 0.0, lambda key: done.__setitem__(key, run.engine.now))
    return run, ex, done


def test_a_slice_alone_takes_its_owners_link_once_per_other_rank_each_way():
    """Its P - 1 pushes all cross the owner's link in, its P - 1 averages all cross it out: 2(P - 1)·s over the
    owner's rate, however idle the other links are (one host standing for all would say 2(P - 1)/P·s)."""
    P, n = 4, 1_000_000
    cluster = fast_net(P)  # 1 Gbit/s, efficiency 1, no latency
    run, ex, done = _exchange(cluster, credit=P)
    ex.ready(0, n, 0, owner=2)
    run.engine.run()
    rate = cluster.link_bytes_per_s()
    assert done[0] == pytest.approx(2 * (P - 1) * n / rate, rel=1e-6)


def test_credit_bounds_each_ranks_sends_until_a_connection_takes_them(monkeypatch):
    """Rendezvous (send_buffer 0): a send completes when delivered, so a rank has at most `credit` messages on the
    wire. Eager: a connection takes what fits its buffer at once, freeing the credit, so every connection a rank
    has may carry one message (first in, first out within it)."""
    active, peak = collections.Counter(), collections.Counter()
    start = Engine.start

    def counted(engine, activity):
        sender = activity.uses[0][0].name if activity.uses else ""
        active[sender] += 1
        peak[sender] = max(peak[sender], active[sender])
        done = start(engine, activity)
        done.then(lambda _: active.__setitem__(sender, active[sender] - 1))
        return done

    monkeypatch.setattr(Engine, "start", counted)
    for buffer, expect in ((0.0, 1), (1e9, 3)):
        active.clear(), peak.clear()
        run, ex, done = _exchange(fast_net(4, send_buffer=buffer), credit=1)
        for s in range(12):  # three slices owned by each rank, all ready at once
            ex.ready(s, 100_000, s, owner=s % 4)
        run.engine.run()
        assert sorted(done) == list(range(12))
        assert max(peak.values()) == expect, (buffer, dict(peak))


def test_every_host_link_carries_2_p_minus_1_over_p_of_the_gradients_each_way(monkeypatch):
    """A step's bytes over each host's link, out and in: its pushes of the slices others own and its averages of
    the slices it owns, 2(P - 1)/P·S each way for slices spread evenly over the owners."""
    moved = collections.Counter()
    start = Engine.start

    def counted(engine, activity):
        if activity.name.startswith(("push", "result")):
            for resource, _ in activity.uses:
                moved[resource.name] += activity.remaining
        return start(engine, activity)

    monkeypatch.setattr(Engine, "start", counted)
    P, steps = 4, 3
    profile = toy(n=4, params=1_000_000)
    n_slice = 4000  # elements: 1001 slices, about 250 owned by each rank
    simulate(profile, fast_net(P), "p3", steps=steps, slice_size=n_slice, credit=2)
    total = profile.grad_bytes
    sizes = [min(n_slice, total // 4 - a) * 4 for a in range(0, total // 4, n_slice)]
    hosts = ["host", *(f"node {i}" for i in range(1, P))]
    assert sorted(moved) == sorted(f"{h} {d}" for h in hosts for d in ("out", "in"))
    for h, name in enumerate(hosts):
        mine = sum(n for s, n in enumerate(sizes) if s % P == h)
        expect = steps * ((total - mine) + (P - 1) * mine)  # its pushes, then its averages to each other rank
        for d in ("out", "in"):
            assert moved[f"{name} {d}"] == pytest.approx(expect, rel=1e-9), (name, d)
            assert moved[f"{name} {d}"] == pytest.approx(steps * 2 * (P - 1) / P * total, rel=0.005), (name, d)


def test_nothing_new_goes_while_holding_and_everything_once_released():
    """runtime.p3's hold (p3-yield): no message starts while set; what was queued goes once it is cleared."""
    run, ex, done = _exchange(fast_net(4), credit=2)
    ex.holding = True
    ex.ready(0, 100_000, 0, owner=1)
    run.engine.run()
    assert not done and run.engine.now == 0.0
    ex.holding = False
    ex.pump()
    run.engine.run()
    assert list(done) == [0] and run.engine.now > 0.0


def test_flat_p3_is_slower_rank_by_rank_where_its_owners_links_are_the_limit():
    """Where the link is the limit, one host standing for all (CPU compute keeps that model) spreads each slice
    over every link; rank by rank the owners' links carry it: no faster, and slower at 8 ranks with credit 2."""
    profile = toy(n=8, params=1_000_000)
    by_rank = simulate(profile, fast_net(8), "p3", slice_size=250_000, credit=2).t_iter_s
    spread = simulate(profile, fast_net(8, device="cpu"), "p3", slice_size=250_000, credit=2).t_iter_s
    assert math.isfinite(by_rank) and by_rank > spread * 1.05, (by_rank, spread)


def test_the_validation_gives_the_emulated_cluster_the_kernels_send_buffer_where_ranks_send_eagerly():
    """mpicomm.emulation's links send eagerly up to 2.5 Gbit/s (UCX_RNDV_THRESH=inf): a send completes once the
    socket holds it, up to tcp_wmem's largest buffer (the calibration's, else this machine's); faster links use
    rendezvous."""
    from jobs.sim.validate import emulated_cluster

    cal = {"transport": {"rate": 4e8, "cpu_per_byte": 0.0, "latency": 40e-6, "efficiency": 0.94}}
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        wmem = int(f.read().split()[2])
    assert emulated_cluster(8, "1gbit", cal, 2.0, device="gpu").send_buffer == wmem
    assert emulated_cluster(8, "10gbit", cal, 2.0, device="gpu").send_buffer == 0
    # A calibration taken elsewhere carries that machine's buffers (jobs.sim.validate.calibrate records them).
    elsewhere = {**cal, "tcp_wmem_max": 1 << 20, "hosts": {"8": cal}}
    assert emulated_cluster(8, "1gbit", elsewhere, 2.0, device="gpu").send_buffer == 1 << 20
    assert emulated_cluster(8, "10gbit", elsewhere, 2.0, device="gpu").send_buffer == 0


def test_p3_yield_holds_every_ranks_queue_once_a_step(monkeypatch):
    """p3-yield rank by rank: the step's agreement sets every rank's hold, the buffers' average clears it, once a
    step, and the run ends (nothing is left queued behind a hold)."""
    from dataclasses import replace

    from runtime.sim import p3 as sim_p3
    from runtime.sim.simulate import STEPS

    held, release = [], sim_p3.P3Schedule._release

    def released(self):
        held.append(self.owners.holding)
        release(self)
        assert not self.owners.holding

    monkeypatch.setattr(sim_p3.P3Schedule, "_release", released)
    buffered = replace(toy(n=4, params=1_000_000), buffer_elements=50_000, watched_buffers=1)  # not carried
    t = simulate(buffered, fast_net(4, latency=50e-6), "p3-yield").t_iter_s
    assert math.isfinite(t) and held == [True] * STEPS, held


def test_simulate_takes_a_send_buffer_and_refuses_a_negative_one(capsys):
    """`mpitrain simulate --send-buffer BYTES` reaches the projected cluster; below 0 it is a one-line error."""
    from jobs.simulate import cluster_for, parse_args

    base = ["--model", "resnet50-224", "--compute", "emulated:v100", "--nodes", "8", "--ranks-per-node", "1"]
    args = parse_args([*base, "--send-buffer", "4194304"])
    assert cluster_for(args, 8, 10e9, toy(n=2), {}).send_buffer == 4194304
    assert cluster_for(parse_args(base), 8, 10e9, toy(n=2), {}).send_buffer == 0
    with pytest.raises(SystemExit) as exit:
        parse_args([*base, "--send-buffer", "-1"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("error: --send-buffer:") and len(err.strip().splitlines()) == 1
