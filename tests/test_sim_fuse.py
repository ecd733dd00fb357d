"""wfbp's fuse_bytes="auto" in the simulator: the runtime's size on the simulated cluster, and what it buys."""

from __future__ import annotations

import dataclasses

from mpicomm.algorithms import FUSE_MAX, FUSE_MIN, FUSE_SHARE
from runtime.sim import Cluster, Layer, Profile, simulate
from runtime.sim.collectives import _chooser, fuse_size
from runtime.sim.dataparallel import BucketSchedule, Run
from test_sim import toy


def test_wfbp_buckets_grow_where_a_small_buckets_steps_cost_more_than_its_bytes():
    """fuse_bytes="auto" (the runtime's default): 1 MiB on 4 hosts at 1 Gbit/s, the largest on 128 nodes x 8 at
    100 Gbit/s; each size the smallest that spends >= 95 % of its allreduce on bytes, and at most 1/8 of the
    gradient, as the runtime settles it."""
    small, big = Cluster(nodes=4, latency=67e-6, bandwidth=1e9), Cluster(nodes=128, ranks_per_node=8, bandwidth=100e9)
    assert fuse_size(small, None, 1e12) == FUSE_MIN and fuse_size(big, None, 1e12) == FUSE_MAX
    assert fuse_size(big, None, 100e6) == 8 << 20  # 8 buckets or more: the power of two under 12.5 MB
    mid = Cluster(nodes=128, ranks_per_node=8, bandwidth=10e9)
    chooser = _chooser(mid, "auto")
    m, lay = chooser.model, chooser.layout

    def share(n):
        how = chooser.choose(n)
        return dataclasses.replace(m, alpha=0.0).time(n, lay, how) / m.time(n, lay, how)
    got = fuse_size(mid, None, 1e12)
    assert FUSE_MIN < got < FUSE_MAX and share(got) >= FUSE_SHARE > share(got // 2)
    # Communication-bound (64 gradients of 1 MB, 0.1 ms of compute each): fewer steps, a shorter exchange.
    layers = tuple(Layer(f"l{i}", 1e-4, 2e-4, (250_000,)) for i in range(64))
    comm_bound = Profile("many", 16, "gpu", layers, step_s=64 * 3e-4, optimizer_s=0.0, other_s=0.0)
    sizes = [size for size, _ in BucketSchedule(Run(comm_bound, mid)).buckets]
    assert len(sizes) <= 16 and len(BucketSchedule(Run(comm_bound, small)).buckets) == 32  # 2 MB each
    one_mib = simulate(comm_bound, mid, "wfbp", fuse_bytes=FUSE_MIN).t_iter_s
    assert simulate(comm_bound, mid, "wfbp").t_iter_s < 0.9 * one_mib
    # Compute-bound: only the last bucket shows, at most an eighth of the exchange.
    p = toy(n=16, params=2_000_000)
    exchange = simulate(p, mid, "allreduce").t_iter_s - p.compute_s
    assert simulate(p, mid, "wfbp").t_iter_s <= simulate(p, mid, "wfbp", fuse_bytes=FUSE_MIN).t_iter_s + exchange / 8
