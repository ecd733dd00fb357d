"""P3 with node-local aggregation: the same averages, each slice across a node's link once each way."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

from conftest import assert_everywhere
from layout_helpers import sub_topology
from mpicomm.sliced_ps import SlicedExchange

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

SIZES, SLICE = [1000, 7, 12_345, 5, 3000], 256


@pytest.fixture(params=[(4, 2), (4, 1), (2, 2), (3, 3)], ids=lambda p: f"P{p[0]}x{p[1]}")
def layout(request, world):
    with sub_topology(world, *request.param) as (_, topo):
        yield topo


def run(topo, aggregate: bool, steps: int = 2, local_rate=None, peaks=None, window: bool = True, windows=None):
    """Poll a SlicedExchange of random gradients to the end, `steps` times; (buffers, their inputs, cross bytes).
    peaks: a list that gets the pacer's peak (None when nothing was paced); windows: whether it had a node window."""
    r = topo.world.Get_rank()
    buffers = [torch.empty(n) for n in SIZES]
    ex = SlicedExchange(topo.world, buffers, [(t, 0, n) for t, n in enumerate(SIZES)], SLICE, credit=4,
                        nodes=topo.nodes, node_aggregation=aggregate, local_rate=local_rate,
                        node_window=window)
    inputs = []
    try:
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * step + r)
            for b in buffers:
                b.copy_(torch.randn(b.numel(), generator=gen))
            inputs = [b.clone() for b in buffers]
            ex.begin()
            for t in reversed(range(len(SIZES))):  # backward's order
                ex.ready(t)
            while not ex.poll():
                pass
            assert all(ex.tensor_done)
        if peaks is not None:
            peaks.append(None if ex.pacer is None else ex.pacer.peak)
        if windows is not None:
            windows.append(ex.window is not None)
        return buffers, inputs, ex.cross_bytes / steps
    finally:
        ex.free()


def test_averages_equal_the_flat_exchange_and_every_rank_holds_the_same(layout):
    topo = layout
    comm, P = topo.world, topo.size
    got, inputs, _ = run(topo, aggregate=True)
    flat, _, _ = run(topo, aggregate=False)
    ok = True
    for g, f, x in zip(got, flat, inputs):
        ref = x.numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, ref)
        ok &= bool(np.allclose(g.numpy(), ref / P, rtol=1e-5, atol=1e-6) and torch.allclose(g, f, rtol=1e-5, atol=1e-6))
        first = g.numpy().copy()
        comm.Bcast(first, root=0)
        ok &= bool(np.array_equal(first, g.numpy()))  # one owner computed it, everyone holds its bits
    assert_everywhere(comm, ok, f"averages on {topo}")


def test_each_slice_crosses_a_nodes_link_once_each_way(layout):
    topo = layout
    comm, N, L = topo.world, topo.num_nodes, topo.local_size
    total = 4 * sum(SIZES)  # float32 bytes of every slice
    _, _, mine = run(topo, aggregate=True)
    _, _, flat = run(topo, aggregate=False)
    both = np.array([mine, flat])
    comm.Allreduce(MPI.IN_PLACE, both)
    # Node-local: each slice goes to its owner's node from the N-1 others and comes back: 2(N-1)·S over all
    # links, 2(N-1)/N·S per node on average, as a ring. Flat: each of a node's L ranks pushes and pulls its own.
    expect = 2 * (N - 1) * total  # with one rank a node (or one node) the same as the flat exchange
    assert_everywhere(comm, both[0] == expect and both[1] == 2 * L * (N - 1) * total,
                      f"cross bytes {both.tolist()} on {topo}, expected {expect} and {2 * L * (N - 1) * total}")


def test_paced_node_pushes_give_the_same_averages_one_at_a_time(layout):
    """Pushes to the node's aggregator paced (local_rate): the averages are the unpaced ones to the bit, and such
    pushes went one at a time, where a node has two ranks or more and there are two nodes or more."""
    topo = layout
    peaks = []
    paced, _, _ = run(topo, aggregate=True, local_rate=4e6, peaks=peaks, window=False)  # ~1 KB slices: ms a step
    free, _, _ = run(topo, aggregate=True, window=False)
    same = all(torch.equal(a, b) for a, b in zip(paced, free))
    # Every rank of a node but its aggregator of a slice pushes it there, so each pushes some (SIZES > L slices).
    expect = 1 if topo.num_nodes > 1 and topo.local_size > 1 else None
    assert_everywhere(topo.world, same and peaks == [expect], f"bitwise equal: {same}, pacer peak {peaks} on "
                      f"{topo} (expected {expect})")


def test_the_node_window_gives_the_messages_averages_to_the_bit(layout):
    """Pushes and results inside a node through the shared window (the default) or as messages: the same sums
    in the same order, so the same bits, and the same bytes across the links; the window exists exactly where
    slices are aggregated inside nodes (two nodes or more of two ranks or more), and nothing is paced through it."""
    topo = layout
    windows, peaks = [], []
    shared, _, across = run(topo, aggregate=True, windows=windows, local_rate=4e6, peaks=peaks)
    sent, _, across_sent = run(topo, aggregate=True, window=False)
    same = all(torch.equal(a, b) for a, b in zip(shared, sent))
    expect = topo.num_nodes > 1 and topo.local_size > 1
    assert_everywhere(topo.world, same and across == across_sent and windows == [expect] and peaks == [None],
                      f"bitwise equal: {same}, cross bytes {across} against {across_sent}, window {windows} "
                      f"(expected {expect}), pacer {peaks} on {topo}")
