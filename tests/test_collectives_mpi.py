"""Topology-aware allreduce: every algorithm equals MPI's, on every layout of 1-4 ranks, and fails together."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from mpi4py import MPI

from conftest import assert_everywhere
from layout_helpers import sub_topology
from mpicomm import IN_PLACE, CollectiveMismatchError, Collectives, Topology, block_counts, wait_all
from mpicomm.algorithms import ALGORITHMS, Chooser, CostModel, Layout
from mpicomm.link_probe import measured_link
from mpicomm.scratch import SCRATCH

pytestmark = pytest.mark.mpi

MI = 1 << 20
LAYOUTS = [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 1), (4, 2), (4, 4)]  # (ranks, ranks per node)


@pytest.fixture(params=LAYOUTS, ids=lambda p: f"P{p[0]}x{p[1]}")
def layout(request, world):
    """(comm, Topology) of the first P world ranks, L ranks per (emulated) node; the other ranks skip."""
    with sub_topology(world, *request.param) as both:
        yield both


def lengths(P):
    return sorted({0, 1, P - 1, P + 1, 2 * P * P + 3, 300_007})  # the last: several 64 KiB chunks


def data(n, dtype, rank, integer=True):
    if integer:  # exact sums in every dtype: every algorithm must give MPI's bits
        return ((np.arange(n) * (rank + 3)) % 11 - 5 + rank).astype(dtype)
    return np.random.default_rng(1000 + rank).standard_normal(n).astype(dtype)


@pytest.mark.parametrize("algorithm", ALGORITHMS + ("auto",))
def test_every_algorithm_equals_native(layout, algorithm):
    comm, topo = layout
    with Collectives(topo, algorithm=algorithm, chunk_bytes=64 << 10) as coll:
        for n in lengths(comm.Get_size()):
            for dtype in (np.float32, np.int64):
                x = data(n, dtype, comm.Get_rank())
                ref = np.empty_like(x)
                comm.Allreduce(x, ref)
                out = np.empty_like(x)
                coll.allreduce(x, out).wait()
                inplace = x.copy()
                coll.allreduce(inplace).wait()
                assert_everywhere(comm, np.array_equal(out, ref) and np.array_equal(inplace, ref),
                                  f"{algorithm} n={n} {dtype.__name__} on {topo}")
        if algorithm != "auto":
            expect = "ring" if algorithm == "hierarchical" and not coll.layout.hierarchical else algorithm
            used = {k for k, v in coll.counts.items() if v}
            assert_everywhere(comm, comm.Get_size() == 1 or used == {expect}, f"{algorithm} ran as {used}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_float_results_are_identical_on_every_rank(layout, algorithm):
    """Another order of additions than MPI's, but within float32 rounding, and the same bits everywhere."""
    comm, topo = layout
    with Collectives(topo, algorithm=algorithm, chunk_bytes=64 << 10) as coll:
        x = torch.from_numpy(data(100_003, np.float32, comm.Get_rank(), integer=False))
        ref = x.numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, ref)
        got = coll.allreduce(x).wait()
        first = got.numpy().copy()
        comm.Bcast(first, root=0)
        assert_everywhere(comm, got is x and np.allclose(x.numpy(), ref, rtol=1e-5, atol=1e-5)
                          and np.array_equal(x.numpy(), first), f"{algorithm} on {topo}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_repeated_allreduce_reuses_its_scratch(layout, algorithm):
    """A training loop's steady state allocates nothing: the next allreduce of a size reuses the last one's."""
    comm, topo = layout
    with Collectives(topo, algorithm=algorithm, chunk_bytes=64 << 10) as coll:
        x = data(300_007, np.float32, comm.Get_rank())
        ref = np.empty_like(x)
        comm.Allreduce(x, ref)
        coll.allreduce(x.copy()).wait()
        before, same = SCRATCH.allocated, True
        for _ in range(3):
            y = x.copy()
            coll.allreduce(y).wait()
            same &= np.array_equal(y, ref)
        assert_everywhere(comm, same and SCRATCH.allocated == before,
                          f"{algorithm} on {topo}: equal {same}, {SCRATCH.allocated - before} scratch buffers allocated")


def test_a_repeated_reduce_scatter_reuses_its_scratch(layout):
    """PTO's step: in place (MPI's own below the crossover on one level, whose block r goes through scratch) and
    out of place (the hierarchy's partial sums, on a copy): after the first call of a size, none allocates a
    buffer of the data's size (numpy reports its arrays to tracemalloc)."""
    import tracemalloc

    comm, topo = layout
    P, r = comm.Get_size(), comm.Get_rank()
    with Collectives(topo, chunk_bytes=64 << 10) as coll:
        x = data(300_007, np.float32, r)
        counts = block_counts(x.size, P)
        ref = np.empty(counts[r], np.float32)
        comm.Reduce_scatter(x, ref, counts)
        coll.reduce_scatter(x.copy()).wait()
        coll.reduce_scatter(x, np.empty_like(ref)).wait()
        same, peaks = True, []
        tracemalloc.start()
        try:
            for _ in range(3):
                y, out = x.copy(), np.empty_like(ref)
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
                same &= np.array_equal(coll.reduce_scatter(y).wait(), ref)
                coll.reduce_scatter(x, out).wait()
                peaks.append(tracemalloc.get_traced_memory()[1] - base)
                same &= np.array_equal(out, ref)
        finally:
            tracemalloc.stop()
        # The smallest buffer either path would allocate is block r (1/P of the data): bookkeeping is far below.
        assert_everywhere(comm, same and max(peaks) < ref.nbytes // 2,
                          f"on {topo}: equal {same}, peak bytes allocated per step {peaks} (block {ref.nbytes})")


def test_buckets_in_flight_started_in_any_order(layout):
    """wfbp's use: explicit tags, several allreduces in flight, started in a different order on each rank."""
    comm, topo = layout
    P, r = comm.Get_size(), comm.Get_rank()
    sizes = [3, 5000, 70_001, 300_000, 17]  # across the auto choice's crossovers
    with Collectives(topo, validate=False, chunk_bytes=32 << 10) as coll:
        xs = [data(n, np.float64, r) for n in sizes]
        refs = [np.empty_like(x) for x in xs]
        for x, ref in zip(xs, refs):
            comm.Allreduce(x, ref)
        order = np.random.default_rng(r).permutation(len(xs))
        handles = {int(b): coll.allreduce(xs[b], tag=int(b)) for b in order}
        wait_all([handles[b] for b in range(len(xs))])
        assert_everywhere(comm, all(np.array_equal(x, ref) for x, ref in zip(xs, refs)), f"{topo}")


def test_auto_picks_by_size_and_layout(world):
    """The cost model: recursive doubling for a small message; the hierarchy for a large one on two levels
    whose link is slower than shared memory (1 Gbit/s here)."""
    slow = CostModel(beta_cross=8e-9)
    two = Chooser(Layout(8, 4, 2), "auto", model=slow)
    assert two.choose(4 << 10) == "doubling"
    assert two.choose(4 << 20) == "hierarchical"
    flat = Chooser(Layout(4, 1, 4), "auto")
    # Large on one node: a bandwidth-optimal algorithm (2(P-1)/P of the bytes), never doubling's log2 P copies.
    assert flat.choose(4 << 10) == "doubling" and flat.choose(64 << 20) in ("ring", "rabenseifner")
    big = Chooser(Layout(1024, 128, 8), "auto", model=slow)
    assert big.choose(1 << 20) == "hierarchical"
    assert Chooser(Layout(4, 2, 2), "hierarchical").choose(1) == "hierarchical"
    assert Chooser(Layout(4, 4, 1), "hierarchical").choose(1 << 20) == "ring"  # one rank a node: the flat ring


def test_a_measured_table_decides_on_its_own_layout(world, tmp_path_factory):
    path = tmp_path_factory.mktemp("table") / "allreduce.json"
    doc = {"layout": {"ranks": 4, "nodes": 2, "per_node": 2},
           "allreduce": [[65536, "ring"], [1 << 20, "doubling"], [None, "hierarchical"]]}
    path.write_text(json.dumps(doc))
    mine = Chooser(Layout(4, 2, 2), "auto", str(path))
    assert [mine.choose(n) for n in (4096, 65536, 4 << 20)] == ["ring", "doubling", "hierarchical"]
    other = Chooser(Layout(8, 4, 2), "auto", str(path))
    assert other.note() and "measured on 4 ranks = 2 nodes x 2" in other.note()
    assert other.choose(4 << 20) == Chooser(Layout(8, 4, 2), "auto").choose(4 << 20)
    path.write_text(json.dumps({**doc, "allreduce": [[None, "tree"]]}))
    with pytest.raises(ValueError, match="unknown algorithm"):
        Chooser(Layout(4, 2, 2), "auto", str(path))


def test_ranks_with_different_settings_fail_together(world):
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    with Topology(world) as topo:
        mine = "doubling" if world.Get_rank() == 1 else "ring"
        with pytest.raises(CollectiveMismatchError, match=r"rank 0, 2, 3: allreduce algorithm ring; rank 1: "
                                                          r"allreduce algorithm doubling|rank 0: .*ring; rank 1"):
            Collectives(topo, algorithm=mine)
        bad = "tree" if world.Get_rank() == 0 else "ring"
        with pytest.raises((CollectiveMismatchError, ValueError), match="tree"):
            Collectives(topo, algorithm=bad)
        with pytest.raises(ValueError, match="unknown allreduce algorithm 'tree'"):  # the same on every rank
            Collectives(topo, algorithm="tree")


def test_a_link_rate_set_on_some_ranks_only_is_named(world, monkeypatch):
    """Whether the link is probed (a collective) follows $MPITRAIN_LINK_BANDWIDTH: ranks must agree on it."""
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    if world.Get_rank() == 1:
        monkeypatch.setenv("MPITRAIN_LINK_BANDWIDTH", "1gbit")
    else:
        monkeypatch.delenv("MPITRAIN_LINK_BANDWIDTH", raising=False)
    with Topology(world, ranks_per_node=1) as topo:
        with pytest.raises(CollectiveMismatchError, match=r"rank 1: \$MPITRAIN_LINK_BANDWIDTH='1gbit'"):
            CostModel.measured(topo)


def test_the_named_hierarchy_chooses_its_cross_step_by_the_measured_link(world, monkeypatch):
    """The model the dense strategies' collectives get (CostModel.for_algorithm): auto and the hierarchy (its
    cross-node algorithm) get the probed link, the others the defaults; every rank the same."""
    link_model = CostModel.for_algorithm
    if world.Get_size() < 4:
        pytest.skip("needs 2 nodes of 2")
    monkeypatch.delenv("MPITRAIN_LINK_BANDWIDTH", raising=False)
    with Topology(world, ranks_per_node=2) as topo:
        probed = CostModel.measured(topo)
        assert link_model(topo, "hierarchical") == probed == link_model(topo, "auto") == link_model(topo, None)
        assert link_model(topo, "ring") == link_model(topo, "doubling") == CostModel()
        mine = np.array([probed.beta_cross, probed.alpha])
        assert_everywhere(world, probed != CostModel() and np.array_equal(mine, world.bcast(mine)), f"{probed}")
        # alpha is the probe's step, faster than the default or not (here: tens of microseconds)
        step = measured_link(topo.world).step_time
        assert_everywhere(world, probed.alpha == step > 0, f"alpha {probed.alpha} against the probed step {step}")


def test_lengths_that_differ_fail_together_naming_them(world):
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    r = world.Get_rank()
    with Topology(world, ranks_per_node=1) as topo, Collectives(topo, validate=True) as coll:
        n = 4 if r != 1 else 3 << 20  # rank 1 would take another algorithm: it must not hang the others
        with pytest.raises(CollectiveMismatchError, match=r"ranks disagree on length \(rank 0: 4, rank 1: 3145728"):
            coll.allreduce(np.ones(n, np.float32)).wait()
        got = coll.allreduce(np.ones(5, np.float32)).wait()  # and the collectives go on working
        assert_everywhere(world, np.array_equal(got, np.full(5, world.Get_size(), np.float32)), "after")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_detected_nodes(world, algorithm):
    """The launcher's own layout (2 fake hosts x 2 in `make test-mpi-hosts`): Split_type finds the nodes."""
    with Topology(world) as topo, Collectives(topo, algorithm=algorithm) as coll:
        x = data(3 * MI + 1, np.float32, world.Get_rank())
        ref = np.empty_like(x)
        world.Allreduce(x, ref)
        coll.allreduce(x).wait()
        assert_everywhere(world, np.array_equal(x, ref), f"{algorithm} on {topo}")


@pytest.mark.parametrize("node_window", ["auto", True])
def test_reduce_scatter_and_allgatherv_keep_the_flat_blocks(layout, node_window):
    """PTO's pair: on two levels (placed node by node) by the hierarchy, block r on rank r as the ring leaves it;
    its node steps as messages or through the shared window (mpicomm.node_stage)."""
    comm, topo = layout
    P, r = comm.Get_size(), comm.Get_rank()
    with Collectives(topo, chunk_bytes=64 << 10, node_window=node_window) as coll:
        for n in lengths(P):
            x = data(n, np.int64, r)
            counts = block_counts(n, P)
            ref = np.empty(counts[r], np.int64)
            comm.Reduce_scatter(x, ref, counts)
            apart = np.empty(counts[r], np.int64)
            kept = x.copy()
            coll.reduce_scatter(x, apart).wait()  # out of place: x unchanged
            unchanged = np.array_equal(x, kept)
            got = coll.reduce_scatter(x).wait()
            full = np.zeros(n, np.int64)
            lo = sum(counts[:r])
            full[lo:lo + counts[r]] = ref
            every = np.empty(n, np.int64)
            comm.Allgatherv(ref, [every, counts])
            coll.allgatherv(IN_PLACE, full, counts=counts).wait()
            other = coll.allgatherv(ref, np.empty(n, np.int64), counts=counts).wait()
            assert_everywhere(comm, np.array_equal(got, ref) and np.shares_memory(got, x) | (counts[r] == 0)
                              and unchanged and np.array_equal(apart, ref)
                              and np.array_equal(full, every) and np.array_equal(other, every), f"n={n} on {topo}")
        took = coll.blocks_hierarchical
        assert_everywhere(comm, took == (topo.num_nodes > 1 and topo.local_size > 1), f"hierarchical: {took}")
        assert_everywhere(comm, node_window != True or bool(coll.stages) == took, f"window: {len(coll.stages)}")  # noqa: E712


def test_reduce_scatter_lengths_that_differ_fail_together(world):
    if world.Get_size() != 4:
        pytest.skip("needs 4 ranks")
    with Topology(world, ranks_per_node=2) as topo, Collectives(topo, validate=True) as coll:
        n = 8 if world.Get_rank() != 2 else 12
        with pytest.raises(CollectiveMismatchError, match=r"reduce_scatter: ranks disagree on length .*rank 2: 12"):
            coll.reduce_scatter(np.ones(n, np.float32)).wait()
        with pytest.raises((CollectiveMismatchError, ValueError), match=r"counts|rank\(s\) \[0\] passed an invalid"):
            coll.allgatherv(IN_PLACE, np.ones(8, np.float32), counts=[2, 2, 2, 2 + (world.Get_rank() == 0)]).wait()


def test_allgatherv_with_out_and_counts_on_some_ranks_only_fails_together(world):
    """Both given: the hierarchy, on the Collectives' communicator; otherwise the flat ring, on its own. Agreed on
    the first before either, or the two sides would wait on different communicators."""
    if world.Get_size() != 4:
        pytest.skip("needs 4 ranks")
    r = world.Get_rank()
    with Topology(world, ranks_per_node=2) as topo, Collectives(topo, validate=True) as coll:
        x = np.full(2, r, np.float32)
        out = np.empty(8, np.float32)
        with pytest.raises(CollectiveMismatchError, match=r"every rank passes out and counts, or every rank leaves "
                                                          r"one out \(rank 0: out and counts, rank 1: not both"):
            coll.allgatherv(x, out, counts=[2] * 4 if r in (0, 2) else None).wait()
        got = coll.allgatherv(x).wait()  # every rank leaves both out: the flat ring, still usable
        assert_everywhere(world, np.array_equal(got, np.repeat(np.arange(4, dtype=np.float32), 2)), f"{got}")
