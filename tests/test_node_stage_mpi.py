"""The hierarchy's node steps through a shared window: the messages' results to the bit, any number in flight."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

from conftest import assert_everywhere, queued
from layout_helpers import sub_topology
from mpicomm import CollectiveMismatchError, Collectives
from mpicomm.hierarchical import PIECE_BYTES, pieces
from mpicomm.node_stage import HALF_BYTES, SLOTS
from mpicomm.single_copy import single_copy

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]


@pytest.fixture(params=[(2, 2), (4, 2), (3, 3), (4, 1)], ids=lambda p: f"P{p[0]}x{p[1]}")
def layout(request, world):
    with sub_topology(world, *request.param) as both:
        yield both


def random(n, rank, dtype=torch.float32, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed * 1000 + rank)).to(dtype)


def test_window_and_messages_give_the_same_bits(layout):
    """Lengths of one element to several rounds of a half per block and several pieces (lanes); sum and max;
    float32 tensors and float64 arrays. The window exists exactly on two levels."""
    comm, topo = layout
    r, L = comm.Get_rank(), topo.local_size
    rounds = 3 * HALF_BYTES // 4  # float32 elements: about 3 rounds of every block's part at any L
    lengths = [1, L + 1, 12_345, rounds, PIECE_BYTES // 4 * 2 + 3]
    assert pieces(lengths[-1] * 4) == 2
    with Collectives(topo, algorithm="hierarchical", node_window=True) as win, \
            Collectives(topo, algorithm="hierarchical", node_window=False) as msg:
        two_levels = topo.num_nodes > 1 and L > 1
        assert_everywhere(comm, (len(win.stages) > 0) == two_levels and not msg.stages,
                          f"{len(win.stages)} stages with the window, {len(msg.stages)} without, on {topo}")
        for n in lengths:
            for op in ("sum", "max"):
                x = random(n, r, seed=n)
                y = x.clone()
                ref = x.double().numpy().copy()
                comm.Allreduce(x.double().numpy().copy(), ref, op={"sum": MPI.SUM, "max": MPI.MAX}[op])
                win.allreduce(x, op=op).wait()
                msg.allreduce(y, op=op).wait()
                a = np.random.default_rng(n + r).standard_normal(n)
                b = a.copy()
                win.allreduce(a, op=op).wait()
                msg.allreduce(b, op=op).wait()
                first = x.numpy().copy()
                comm.Bcast(first, root=0)
                assert_everywhere(comm, torch.equal(x, y) and np.array_equal(a, b) and np.array_equal(first, x.numpy())
                                  and np.allclose(x.double().numpy(), ref, rtol=1e-5, atol=1e-4),
                                  f"n={n} {op} on {topo}")
        assert_everywhere(comm, all(s.as_messages == 0 and True not in s.held for s in win.stages),
                          "one allreduce at a time: every call found a slot, and gave it back")


def test_more_allreduces_in_flight_than_slots_waited_in_any_order(layout):
    """SLOTS + 3 allreduces on one lane at once: the calls that find every slot held send their parts as
    messages; none waits for another, so waiting for the last first completes, as with the node ring."""
    comm, topo = layout
    r = comm.Get_rank()
    n = 300_001  # one piece: every call on the first lane
    with Collectives(topo, algorithm="hierarchical", validate=False, node_window=True) as coll:
        xs = [random(n, r, seed=k) for k in range(SLOTS + 3)]
        refs = [x.double().numpy().copy() for x in xs]
        for ref in refs:
            comm.Allreduce(ref.copy(), ref)
        handles = [coll.allreduce(x, tag=k) for k, x in enumerate(xs)]
        for h in reversed(handles):
            h.wait()
        ok = all(np.allclose(x.double().numpy(), ref, rtol=1e-5, atol=1e-4) for x, ref in zip(xs, refs))
        spilled = coll.stages[0].as_messages if coll.stages else None
        assert_everywhere(comm, ok and (spilled is None or spilled > 0), f"{topo}: spilled {spilled}")
        assert_everywhere(comm, all(True not in s.held for s in coll.stages), "every slot given back")


def test_auto_takes_the_window_where_any_rank_lacks_the_single_copy(layout, monkeypatch):
    """node_window="auto" (the default): the window on every rank where MPICH's single copy is off on any (here
    its variable set on rank 0 only), as MPICH's own rule says otherwise; a bad value fails on every rank."""
    comm, topo = layout
    two_levels = topo.num_nodes > 1 and topo.local_size > 1
    here = comm.allreduce(single_copy(MPI.Get_library_version())[0] is not True, op=MPI.LOR)
    with Collectives(topo, algorithm="hierarchical") as coll:
        assert_everywhere(comm, bool(coll.stages) == (two_levels and here), f"{len(coll.stages)} stages, {here}")
    if comm.Get_rank() == 0:
        monkeypatch.setenv("MPIR_CVAR_CH4_CMA_ENABLE", "0")
    with Collectives(topo) as coll:
        assert_everywhere(comm, bool(coll.stages) == two_levels, f"{len(coll.stages)} stages with CMA off on rank 0")
    with pytest.raises(ValueError, match="node_window must be True, False or 'auto', got 'yes'"):
        Collectives(topo, node_window="yes")
    if comm.Get_size() > 1:
        with pytest.raises(CollectiveMismatchError, match="rank 0: node_window=True; rank 1"):
            Collectives(topo, node_window=True if comm.Get_rank() == 0 else "auto")


@pytest.mark.parametrize("window", [True, False], ids=["window", "messages"])
def test_calls_cancelled_everywhere_leave_nothing_for_later_communicators(layout, window):
    """strategy.abort() before a clean close cancels the calls in flight on every rank, each at its own point: a
    header or a ring chunk sent to a peer that had cancelled its receive is left queued. free() drops them
    (mpicomm.quiesce), so that the communicators MPI builds next on the same contexts receive nothing stale; and
    a new Collectives works."""
    comm, topo = layout
    r = comm.Get_rank()
    coll = Collectives(topo, algorithm="hierarchical", validate=False, node_window=window)
    coll.allreduce(random(300_001, r), tag=1).wait()  # its done notices left pending with its slot
    handles = [coll.allreduce(random(3_000_001, r), tag=k) for k in (3, 4)]
    end = time.monotonic() + 0.01 * r  # each rank cancels at another point of the calls
    while time.monotonic() < end:
        for h in handles:
            h.test()
    for h in handles:
        h.cancel()
    coll.free()
    with Collectives(topo, algorithm="hierarchical", node_window=window) as again:  # built as the freed one was
        later = [again.comm] + [ring.comm for ring in [again.flat] + [r for lane in again.lanes for r in lane]] \
            + [c for stage in again.stages for c in (stage.notices, stage.done)] + [comm.Dup() for _ in range(20)]
        comm.Barrier()
        time.sleep(0.2)  # what a peer sent before its free() has landed by now
        stale = queued(later)
        for c in later[-20:]:
            c.Free()
        assert_everywhere(comm, not stale, f"{topo}: stale messages (source, tag, bytes) {stale}")
        y = torch.ones(300_001)
        again.allreduce(y).wait()
        assert_everywhere(comm, bool(torch.all(y == comm.Get_size())), f"after the cancelled calls on {topo}")
