"""The simulator's pipelines: 1F1B's ticks, measured splits, weight versions, and the stage replicas' average."""

from __future__ import annotations

import dataclasses
import random

import pytest

from runtime.sim import simulate
from test_sim import fast_net, toy


@pytest.fixture
def seen_on_arrival(monkeypatch):
    """Messages noticed the moment they land (no wait_until polling): these tests time the schedule and the links."""
    monkeypatch.setattr("runtime.sim.pipeline.noticed", lambda waited: waited)


def test_pipeline_flush_matches_the_1f1b_tick_count_and_async_never_drains(seen_on_arrival):
    from runtime.pipeline.schedule import ticks

    p, c = toy(n=8, params=1000), fast_net(4, bw=100e9)  # 2 layers a stage, messages ~free
    M = 8
    per_op = 2 * (0.01 + 0.02) / M  # a forward and a backward of one micro-batch, per stage
    span = max(max(d.values()) for d in ticks(4, M)) + 1  # ticks of one drained step, F and B one tick each
    flush = simulate(p, c, "pipeline-flush", microbatches=M).t_iter_s
    assert flush == pytest.approx((M + 4 - 1) * per_op, rel=0.01)
    assert span == 2 * (M + 4 - 1)
    assert simulate(p, c, "pipeline-spectrain", microbatches=M).t_iter_s == pytest.approx(M * per_op, rel=0.01)


def test_a_pipeline_takes_a_measured_split_and_a_profile_of_one_micro_batch():
    M, c = 8, fast_net(4, bw=100e9)
    micro = toy(n=8, params=1000)
    whole = dataclasses.replace(micro, batch_size=micro.batch_size * M, layers=tuple(
        dataclasses.replace(l, fwd_s=l.fwd_s * M, bwd_s=l.bwd_s * M, act_bytes=l.act_bytes * M) for l in micro.layers))
    # The step's batch divided by M is the micro-batch's profile taken as it is.
    assert simulate(micro, c, "pipeline-flush", microbatches=M, per_microbatch=True).t_iter_s == \
        pytest.approx(simulate(whole, c, "pipeline-flush", microbatches=M).t_iter_s, rel=1e-6)
    # A split with all but three layers on the first stage: that stage sets the pace.
    r = simulate(micro, c, "pipeline-vanilla", microbatches=M, per_microbatch=True, balance=[5, 1, 1, 1])
    assert r.details["stages"] == ["0-4", "5-5", "6-6", "7-7"]
    assert r.t_iter_s == pytest.approx(M * 5 * (0.01 + 0.02), rel=0.01)
    with pytest.raises(ValueError, match="adding up to the profile's 8 layers"):
        simulate(micro, c, "pipeline-vanilla", microbatches=M, balance=[4, 4, 1, 1])


def test_stage_replicas_average_by_the_runtimes_auto_choice():
    """64 replicas of each of 2 stages, tiny gradients, 1 ms a message step: recursive doubling's 6 steps (the
    auto choice of the replica group's DistributedOptimizer), not the flat ring's 126."""
    p = toy(n=8, params=1000)
    one = simulate(p, fast_net(2, latency=1e-3, bw=100e9), "pipeline-flush", stages=2).t_iter_s
    many = simulate(p, fast_net(128, latency=1e-3, bw=100e9), "pipeline-flush", stages=2).t_iter_s
    assert 6e-3 <= many - one < 20e-3


def test_asynchronous_pipelines_update_every_micro_batch_and_pay_their_weight_versions():
    M, c = 8, fast_net(4, bw=100e9)
    p = dataclasses.replace(toy(n=8, params=1000, opt=0.004), device="cuda", memory_gbs=1e-3)
    weights_s = p.grad_bytes / 4 / 1e6  # a pass over a stage's 16 KB: 16 ms
    t = {m: simulate(p, c, f"pipeline-{m}", microbatches=M).t_iter_s for m in ("vanilla", "stash", "spectrain")}
    share = p.optimizer_s / 4 + weights_s  # a stage's update and its zero_grad's memset
    assert t["vanilla"] == pytest.approx(M * (2 * (0.01 + 0.02) / M + share), rel=0.01)
    assert t["vanilla"] < t["stash"] < t["spectrain"]  # 2 passes a forward; 7 a forward and 3 a backward


def test_a_stages_messages_to_one_peer_arrive_first_in_first_out(seen_on_arrival):
    """Two stages; stage 0 computes nothing, stage 1 m a micro-batch (F and B m/2 each); a message takes m.
    Stage 0 sends its two warm-up activations back to back: on one connection the first arrives at m, the
    second at 2m (shared fairly, both at 2m). From then every two micro-batches take 3m (a gradient back,
    the next activation out, stage 1's two passes), so a step takes (1.5·M + 1)·m; fairly shared, m more."""
    M, m = 8, 0.01
    layers = (*toy(n=1, fwd=1e-7, bwd=1e-7).layers, *toy(n=1, fwd=m / 2, bwd=m / 2).layers)
    p = dataclasses.replace(toy(n=2), layers=layers)
    c = fast_net(2, bw=layers[0].act_bytes * 8 / m)  # one activation (and one gradient) m on the link
    t = simulate(p, c, "pipeline-flush", microbatches=M, per_microbatch=True).t_iter_s
    assert t == pytest.approx((1.5 * M + 1) * m, rel=1e-3)


def test_asynchronous_stage_replicas_average_every_micro_batch():
    """The asynchronous modes update after every micro-batch, each update averaged over the stage's replicas
    (recursive doubling's 6 steps of 1 ms at 64 replicas); flush averages once a step."""
    M, p = 8, toy(n=8, params=1000)
    extra = {}
    for mode in ("flush", "vanilla"):
        one = simulate(p, fast_net(2, latency=1e-3, bw=100e9), f"pipeline-{mode}", stages=2, microbatches=M).t_iter_s
        many = simulate(p, fast_net(128, latency=1e-3, bw=100e9), f"pipeline-{mode}", stages=2,
                        microbatches=M).t_iter_s
        extra[mode] = many - one
    assert 6e-3 <= extra["flush"] < 20e-3
    assert extra["vanilla"] > M / 2 * extra["flush"]  # once a step, it would add about what flush's adds


def test_an_emulated_links_token_bucket_lets_a_message_after_an_idle_moment_through_at_once(seen_on_arrival):
    """One micro-batch through two stages: an activation out and a gradient back, each m on the link, each after an
    idle moment. A token bucket of a whole message (tc tbf's burst) passes each at once; half a message, half."""
    m = 0.01
    p = toy(n=2, fwd=0.005, bwd=0.005)
    size = p.layers[0].act_bytes
    passes = 2 * (0.005 + 0.005)
    t = {b: simulate(p, fast_net(2, bw=size * 8 / m, burst=b), "pipeline-flush", microbatches=1,
                     per_microbatch=True).t_iter_s for b in (0, size / 2, size)}
    assert t[0] == pytest.approx(passes + 2 * m, rel=1e-3)
    assert t[size / 2] == pytest.approx(passes + m, rel=1e-3)
    assert t[size] == pytest.approx(passes, rel=1e-3)


def test_a_wait_notices_a_message_at_its_next_poll_as_the_runtimes_wait_until_polls():
    """mpicomm.stall.wait_until spins SPIN_SECONDS, then sleeps doubling from MIN_SLEEP to MAX_SLEEP: a message is
    seen at once while it spins, later at the first poll after it lands, never more than MAX_SLEEP late."""
    from mpicomm.stall import MAX_SLEEP, MIN_SLEEP, SPIN_SECONDS
    from runtime.sim.pipeline import noticed

    assert noticed(0.0) == 0.0 and noticed(SPIN_SECONDS) == SPIN_SECONDS
    assert noticed(SPIN_SECONDS + MIN_SLEEP / 2) == pytest.approx(SPIN_SECONDS + MIN_SLEEP)
    assert noticed(SPIN_SECONDS + 1.5 * MIN_SLEEP) == pytest.approx(SPIN_SECONDS + 3 * MIN_SLEEP)  # 10 then 20 us
    for waited in (0.0031, 0.0207, 0.5):
        assert waited <= noticed(waited) <= waited + MAX_SLEEP


def test_a_send_holds_its_stages_host_for_a_measured_time_before_the_message_leaves(seen_on_arrival):
    """send_host (a run's Pipeline.send_times as quantiles): 2 stages, 1 micro-batch, flush: each step sends one
    activation and one gradient, each after its stage's host spent c on it; with a spread, the mean of seeded
    runs, each reproducible."""
    from runtime.sim.pipeline import draw

    p, c = toy(n=4, params=1000), fast_net(2, bw=100e9)
    base = simulate(p, c, "pipeline-flush", microbatches=1).t_iter_s
    fixed = [{"act": [0.004], "grad": None}, {"act": None, "grad": [0.004]}]
    held = simulate(p, c, "pipeline-flush", microbatches=1, send_host=fixed).t_iter_s
    assert held - base == pytest.approx(2 * 0.004, rel=1e-6)
    assert simulate(p, c, "pipeline-flush", microbatches=1, send_host=fixed, seeds=3).t_iter_s == \
        pytest.approx(held, rel=1e-9)  # no spread: every seed alike
    spread = [{"act": [0.0, 0.002, 0.010], "grad": None}, {"act": None, "grad": [0.0, 0.002, 0.010]}]
    one = [simulate(p, c, "pipeline-vanilla", microbatches=4, send_host=spread, seeds=k).t_iter_s for k in (1, 4)]
    assert one == [simulate(p, c, "pipeline-vanilla", microbatches=4, send_host=spread, seeds=k).t_iter_s
                   for k in (1, 4)]
    bare = simulate(p, c, "pipeline-vanilla", microbatches=4).t_iter_s
    assert bare < one[1] < bare + 2 * 0.010 * 4  # each of the step's 4 micro-batches crosses once each way
    with pytest.raises(ValueError, match="seeds must be 1 or more"):
        simulate(p, c, "pipeline-flush", microbatches=1, seeds=0)

    rng = random.Random(0)
    draws = [draw([1.0, 2.0, 4.0], rng) for _ in range(2000)]
    assert 1.0 <= min(draws) and max(draws) <= 4.0 and draw([3.0], rng) == 3.0
    assert sum(d <= 2.0 for d in draws) == pytest.approx(1000, abs=100)  # half below the median


def test_an_op_takes_its_hosts_measured_work_where_that_is_longer_than_its_device_time(seen_on_arrival):
    """op_host (a run's Pipeline.op_times as quantiles): an op lasts the longer of its modelled device time and
    its host's own work; host work shorter than every op changes nothing, longer work sets the step."""
    p, c = toy(n=4, params=1000), fast_net(2, bw=100e9)
    base = simulate(p, c, "pipeline-flush", microbatches=1).t_iter_s
    short = [{"F": [1e-9], "B": [1e-9], "U": [1e-9]}] * 2
    assert simulate(p, c, "pipeline-flush", microbatches=1, op_host=short).t_iter_s == pytest.approx(base, rel=1e-9)
    # 2 stages, 1 micro-batch: the step is stage 0's forward, stage 1's forward and backward, stage 0's backward
    # and update, one after the other (and two small messages): 5 ops of 50 ms of host work each
    long = [{"F": [0.05], "B": [0.05], "U": [0.05]}] * 2
    held = simulate(p, c, "pipeline-flush", microbatches=1, op_host=long).t_iter_s
    assert 5 * 0.05 <= held <= 5 * 0.05 + base, (held, base)
    # a stage with no measurement (None) keeps its modelled times
    assert simulate(p, c, "pipeline-flush", microbatches=1, op_host=[None, None]).t_iter_s == \
        pytest.approx(base, rel=1e-9)
