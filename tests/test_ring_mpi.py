"""Ring collectives equal MPI's native ones for every length, rank count, dtype and buffer kind."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

from conftest import assert_everywhere
from mpicomm import IN_PLACE, CollectiveMismatchError, Ring, block_counts, wait_all

pytestmark = pytest.mark.mpi

MI = 1 << 20


@pytest.fixture(params=[1, 2, 3, 4], ids=lambda p: f"P{p}")
def sub(request, world):
    """A communicator of the first P world ranks and a ring over it; the other ranks skip."""
    P = request.param
    if P > world.Get_size():
        pytest.skip(f"needs {P} ranks")
    comm = world.Split(0 if world.Get_rank() < P else MPI.UNDEFINED, world.Get_rank())
    if comm == MPI.COMM_NULL:
        pytest.skip(f"rank outside the {P}-rank group")
    # Small chunks so pipelining paths are exercised; no latency path: these test the ring itself.
    ring = Ring(comm, chunk_bytes=256 << 10, latency_bytes=0)
    yield comm, ring
    ring.free()
    comm.Free()


def lengths(P):
    return sorted({0, 1, max(P - 1, 0), P + 1, MI, 16 * MI})


def data(n, dtype, rank, integer=True):
    """Integer-valued data (sums are exact in every dtype) that differs per rank."""
    rng = np.random.default_rng(1000 + rank)
    if integer:
        return ((np.arange(n) * (rank + 3)) % 11 - 5 + rank).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def test_allreduce_matches_native_all_lengths(sub):
    comm, ring = sub
    P = comm.Get_size()
    for n in lengths(P):
        for dtype in (np.float32, np.int32) if n < 16 * MI else (np.float32,):
            x = data(n, dtype, comm.Get_rank())
            ref = np.empty_like(x)
            comm.Allreduce(x, ref)
            out = np.empty_like(x)
            ring.allreduce(x, out).wait()
            inplace = x.copy()
            ring.allreduce(inplace).wait()
            assert_everywhere(comm, np.array_equal(out, ref) and np.array_equal(inplace, ref),
                              f"allreduce n={n} {dtype.__name__}")


def test_reduce_scatter_matches_native(sub):
    comm, ring = sub
    P, r = comm.Get_size(), comm.Get_rank()
    for n in lengths(P):
        x = data(n, np.int64 if n < 16 * MI else np.float32, r)
        counts = block_counts(n, P)
        ref = np.empty(counts[r], x.dtype)
        comm.Reduce_scatter(x, ref, counts)
        out = np.empty_like(ref)
        keep = x.copy()
        ring.reduce_scatter(x, out).wait()
        ok = np.array_equal(out, ref) and np.array_equal(x, keep)  # out of place leaves buf alone
        got = ring.reduce_scatter(x).wait()
        ok = ok and np.array_equal(got, ref) and (counts[r] == 0 or np.shares_memory(got, x))
        assert_everywhere(comm, ok, f"reduce_scatter n={n}")


def test_reduce_scatter_takes_only_the_scratch_blocks_its_steps_use(sub):
    """Out of place a ring reduces through up to 3 scratch blocks of 1/P of the data, in turn: P - 1 steps use
    min(3, P - 1) of them (2 ranks: one block, not three of half the data)."""
    from mpicomm.scratch import SCRATCH

    comm, ring = sub
    P, r = comm.Get_size(), comm.Get_rank()
    n = 7 * MI + 3 * P + 1  # a size no other test's scratch has
    x = data(n, np.float32, r)
    out = np.empty(block_counts(n, P)[r], np.float32)
    before = SCRATCH.allocated
    ring.reduce_scatter(x, out).wait()
    taken = SCRATCH.allocated - before
    assert_everywhere(comm, taken == min(3, P - 1), f"{P} ranks took {taken} scratch blocks")


def test_in_place_reduce_scatter_on_mpis_own_path_reuses_its_scratch(world):
    """Below the crossover an in-place reduce-scatter is MPI's, its block r received into scratch and copied into
    buf: after the first call of a size none allocates it again (numpy reports its arrays to tracemalloc)."""
    import tracemalloc

    P, r = world.Get_size(), world.Get_rank()
    with Ring(world) as ring:  # the default crossovers: 300 K elements take MPI_Ireduce_scatter
        x = data(300_007, np.float32, r)
        counts = block_counts(x.size, P)
        ref = np.empty(counts[r], np.float32)
        world.Reduce_scatter(x, ref, counts)
        ring.reduce_scatter(x.copy()).wait()
        same, peaks = True, []
        tracemalloc.start()
        try:
            for _ in range(3):
                y = x.copy()
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
                same &= np.array_equal(ring.reduce_scatter(y).wait(), ref)
                peaks.append(tracemalloc.get_traced_memory()[1] - base)
        finally:
            tracemalloc.stop()
    assert_everywhere(world, same and max(peaks) < ref.nbytes // 2,
                      f"equal {same}, peak bytes allocated per call {peaks} (block {ref.nbytes})")


def test_allgather_and_allgatherv_match_native(sub):
    comm, ring = sub
    P, r = comm.Get_size(), comm.Get_rank()
    for n in lengths(P):
        n = n if n < 16 * MI else 4 * MI  # 16 Mi per rank would gather 64 Mi: already covered by allreduce
        x = data(n, np.float64, r)
        ref = np.empty(n * P, x.dtype)
        comm.Allgather(x, ref)
        got = ring.allgather(x).wait()
        inplace = np.zeros(n * P, x.dtype)
        inplace[r * n:(r + 1) * n] = x
        ring.allgather(IN_PLACE, inplace).wait()
        counts = [n // (i + 1) for i in range(P)]  # uneven blocks, some empty when n is small
        v = data(counts[r], np.float64, r)
        refv = np.empty(sum(counts), v.dtype)
        comm.Allgatherv(v, [refv, counts])
        gotv = ring.allgatherv(v).wait()
        gotv2 = np.empty_like(refv)
        ring.allgatherv(v, gotv2, counts=counts).wait()
        assert_everywhere(comm, np.array_equal(got, ref) and np.array_equal(inplace, ref)
                          and np.array_equal(gotv, refv) and np.array_equal(gotv2, refv), f"allgather n={n}")


def test_broadcast_from_every_root(sub):
    comm, ring = sub
    P, r = comm.Get_size(), comm.Get_rank()
    for n in lengths(P):
        for root in range(P) if n < MI else (P - 1,):
            x = data(n, np.int16 if n < 16 * MI else np.float32, r + 10 * root)
            ref = x.copy()
            comm.Bcast(ref, root=root)
            ring.broadcast(x, root=root).wait()
            assert_everywhere(comm, np.array_equal(x, ref), f"broadcast n={n} root={root}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_torch_tensors_every_dtype(world, dtype):
    """CPU tensors of every supported dtype, multi-dimensional, reduced in place without copies."""
    P, r = world.Get_size(), world.Get_rank()
    with Ring(world) as ring:
        x = (torch.arange(3 * 1001) % 5 + r).to(dtype).reshape(3, 1001)
        ptr = x.data_ptr()
        expected = sum((torch.arange(3 * 1001) % 5 + k) for k in range(P)).reshape(3, 1001)
        got = ring.allreduce(x).wait()
        ok = got is x and x.data_ptr() == ptr and torch.equal(x.to(torch.int64), expected.to(torch.int64) % 256
                                                              if dtype == torch.uint8 else expected)
        y = (torch.arange(3 * 1001) % 5 + r).to(dtype)
        gathered = ring.allgather(y).wait()
        ok = ok and gathered.dtype == dtype and torch.equal(gathered[r * y.numel():(r + 1) * y.numel()], y)
        assert_everywhere(world, bool(ok), f"torch {dtype}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_float_data_within_tolerance(world, dtype):
    P, r = world.Get_size(), world.Get_rank()
    with Ring(world) as ring:
        x = data(100_003, dtype, r, integer=False)
        ref = np.empty_like(x)
        world.Allreduce(x, ref)
        got = ring.allreduce(x.copy()).wait()
        tol = 1e-2 if dtype == np.float16 else 1e-5
        assert_everywhere(world, np.allclose(got, ref, rtol=tol, atol=tol), f"float {dtype}")
        # Every rank ends with bit-identical results: each block is reduced on one rank only.
        first = got.copy()
        world.Bcast(first, root=0)
        assert_everywhere(world, np.array_equal(first, got), "ranks hold different bits")


def test_bfloat16_against_float32_reference(world):
    r = world.Get_rank()
    with Ring(world) as ring:
        x = torch.from_numpy(data(50_001, np.float32, r, integer=False)).to(torch.bfloat16)
        ref = x.to(torch.float32).numpy().copy()
        world.Allreduce(MPI.IN_PLACE, ref)
        got = ring.allreduce(x.clone()).wait().to(torch.float32).numpy()
        assert_everywhere(world, np.allclose(got, ref, rtol=5e-2, atol=5e-2), "bfloat16")


@pytest.mark.parametrize("op,npop", [("max", MPI.MAX), ("min", MPI.MIN), ("prod", MPI.PROD)])
def test_other_reduction_ops(world, op, npop):
    with Ring(world) as ring:
        x = data(10_007, np.int64, world.Get_rank()) % 3 + 1
        ref = np.empty_like(x)
        world.Allreduce(x, ref, op=npop)
        assert_everywhere(world, np.array_equal(ring.allreduce(x, op=op).wait(), ref), op)


def test_many_in_flight_on_distinct_tags_progress_by_test(world):
    """Several collectives started back to back finish correctly in any completion order."""
    P, r = world.Get_size(), world.Get_rank()
    with Ring(world, chunk_bytes=4096) as ring:
        bufs = [np.full(20_000 + i, float(r + i), dtype=np.float64) for i in range(6)]
        handles = [ring.allreduce(b) for b in bufs[:3]]
        handles.append(ring.broadcast(bufs[3], root=P - 1))
        gathered = ring.allgather(bufs[4][:7])
        handles.append(gathered)
        # Drive the last one by polling only, the rest through wait_all.
        rs = ring.reduce_scatter(bufs[5])
        while not rs.test():
            pass
        wait_all(handles)
        expect = [sum(float(k + i) for k in range(P)) for i in range(3)]
        ok = all(np.all(bufs[i] == expect[i]) for i in range(3))
        ok = ok and np.all(bufs[3] == float(P - 1 + 3))
        ok = ok and np.array_equal(gathered.wait(), np.repeat([float(k + 4) for k in range(P)], 7))
        ok = ok and rs.done and np.all(rs.wait() == sum(float(k + 5) for k in range(P)))
        assert_everywhere(world, bool(ok), "in-flight collectives")


def test_explicit_tags_and_reverse_wait_order(world):
    with Ring(world) as ring:
        a = np.ones(30_000, np.float32)
        b = np.full(30_000, 2, np.float32)
        ha = ring.allreduce(a, tag=7)
        hb = ring.allreduce(b, tag=8)
        hb.wait()
        ha.wait()
        P = world.Get_size()
        assert_everywhere(world, np.all(a == P) and np.all(b == 2 * P), "explicit tags")


@pytest.mark.parametrize("validate", [True, False])
def test_explicit_and_automatic_tags_never_meet(world, validate):
    """An explicit tag 0 beside automatically tagged collectives: separate namespaces, correct sums."""
    P = world.Get_size()
    with Ring(world, validate=validate, chunk_bytes=4096) as ring:
        a = np.ones(30_000, np.float32)
        b = np.full(20_000, 2, np.float32)
        c = np.full(10_000, 3, np.float32)
        handles = [ring.allreduce(b), ring.allreduce(a, tag=0), ring.allreduce(c)]
        wait_all(handles[::-1])
        ok = np.all(a == P) and np.all(b == 2 * P) and np.all(c == 3 * P)
        assert_everywhere(world, bool(ok), "explicit tag 0 mixed with automatic tags")


# -- the latency path: MPI's own collectives below the crossover -------------------------------
LAT = 1 << 16  # crossover for these tests: 64 KiB


@pytest.mark.parametrize("validate", [True, False])
def test_latency_path_matches_numpy_every_op_and_dtype(world, validate):
    """Below the crossover every kind goes native (counted), in and out of place, and equals numpy."""
    P, r = world.Get_size(), world.Get_rank()
    with Ring(world, validate=validate, latency_bytes=LAT) as ring:
        ok, n = True, 1001
        for dtype in (np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8):
            every = [data(n, dtype, k) % 4 + 1 for k in range(P)]  # small positives: exact, no wrap
            for op, fn in (("sum", np.sum), ("prod", np.prod), ("max", np.max), ("min", np.min)):
                ref = fn(np.stack(every), axis=0).astype(dtype)
                out = np.empty(n, dtype)
                ok = ok and np.array_equal(ring.allreduce(every[r], out, op=op).wait(), ref)
                inplace = torch.from_numpy(every[r].copy())  # a tensor, reduced where it lies
                ok = ok and ring.allreduce(inplace, op=op).wait() is inplace and np.array_equal(inplace.numpy(), ref)
                same = every[r].copy()  # out aliasing buf: MPI refuses aliased buffers, so in place
                ok = ok and np.array_equal(ring.allreduce(same, same, op=op).wait(), ref)
        x = data(n, np.float64, r)
        total = sum(data(n, np.float64, k) for k in range(P))
        counts = block_counts(n, P)
        lo = sum(counts[:r])
        block = np.empty(counts[r])
        ok = ok and np.array_equal(ring.reduce_scatter(x, block).wait(), total[lo:lo + counts[r]])
        got = ring.reduce_scatter(x.copy()).wait()
        ok = ok and np.array_equal(got, total[lo:lo + counts[r]])
        gathered = np.concatenate([data(n, np.float64, k) for k in range(P)])
        ok = ok and np.array_equal(ring.allgather(x).wait(), gathered)
        inplace = np.zeros(n * P)
        inplace[r * n:(r + 1) * n] = x
        ok = ok and np.array_equal(ring.allgather(IN_PLACE, inplace).wait(), gathered)
        b = torch.from_numpy(x.copy()).to(torch.bfloat16)  # broadcast moves bytes: bfloat16 too
        ok = ok and torch.equal(ring.broadcast(b, root=P - 1).wait(),
                                torch.from_numpy(data(n, np.float64, P - 1)).to(torch.bfloat16))
        calls = 7 * 4 * 3 + 5
        expected = calls if P > 1 else 0
        assert_everywhere(world, ok and ring.native.posted == expected,
                          f"latency path results, {ring.native.posted} of {calls} calls native")


def test_latency_path_skipped_where_it_must_be(world):
    """float16 reductions, allgatherv and (unvalidated) explicit tags stay on the ring; so do large buffers."""
    P = world.Get_size()
    with Ring(world, validate=False, latency_bytes=LAT) as ring:
        h = np.ones(100, np.float16)
        ring.allreduce(h).wait()
        ring.allgatherv(np.ones(3), counts=[3] * P).wait()
        a = np.ones(100, np.float32)
        ring.allreduce(a, tag=5).wait()  # explicit tags may be started in any order without validation
        big = np.ones(LAT // 4, np.float32)
        ring.allreduce(big).wait()
        ok = np.all(h == P) and np.all(a == P) and np.all(big == P) and ring.native.posted == 0
        assert_everywhere(world, bool(ok), f"{ring.native.posted} native calls")


def test_lengths_straddling_the_crossover_fail_together(world):
    """One rank below the crossover, the others above: every rank raises, none takes a path alone."""
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    r = world.Get_rank()
    with Ring(world, validate=True, latency_bytes=LAT) as ring:
        n = LAT // 4 // 2 if r == 0 else LAT // 4 * 2  # rank 0: 32 KiB (native), others 128 KiB (ring)
        with pytest.raises(CollectiveMismatchError, match=rf"disagree on length \(rank 0: {n if r == 0 else LAT // 8}, "
                                                          rf"rank 1: {LAT // 2}"):
            ring.allreduce(np.ones(n, np.float32)).wait()
        with pytest.raises(CollectiveMismatchError, match="disagree on op"):
            ring.allreduce(np.ones(8, np.float32), op="max" if r == 0 else "sum").wait()
        with pytest.raises(CollectiveMismatchError, match=r"disagree on dtype \(rank 0: int32, rank 1: float32"):
            ring.allreduce(np.ones(8, np.int32 if r == 0 else np.float32)).wait()  # same width: MPI would not see it
        with pytest.raises(CollectiveMismatchError, match="disagree on root"):
            ring.broadcast(np.ones(8, np.float32), root=r % 2).wait()
        x = np.ones(10, np.float32)
        ring.allreduce(x).wait()  # still usable: no native call was left behind
        assert_everywhere(world, np.all(x == world.Get_size()) and ring.native.posted == 1, "after mismatches")


def test_latency_handles_in_flight_any_drive_order(world):
    """Native and ring collectives in flight together, driven newest first: one by test() alone, one by a
    progress thread (settling the others' fingerprints from another thread), the rest by wait_all."""
    from mpicomm.progress import HandleTask, ProgressThread

    P, r = world.Get_size(), world.Get_rank()
    with Ring(world, validate=True, latency_bytes=LAT, chunk_bytes=4096) as ring:
        small = [np.full(100 + i, float(r + i)) for i in range(5)]
        large = np.full(LAT, float(r))  # 512 KiB of float64: the ring
        handles = [ring.allreduce(small[0]), ring.allreduce(large), ring.allreduce(small[1]),
                   ring.broadcast(small[2], root=0), ring.allreduce(small[3], op="max"), ring.allreduce(small[4])]
        last = handles.pop()
        while not last.test():  # polled only, while the earlier ones were never driven
            pass
        thread = ProgressThread("test-latency")
        future = thread.submit(HandleTask(handles.pop()))
        wait_all(handles[::-1])
        future.wait(30)
        thread.stop()
        ok = all(np.all(small[i] == sum(float(k + i) for k in range(P))) for i in (0, 1, 4))
        ok = ok and np.all(large == sum(range(P))) and np.all(small[2] == 2.0) and np.all(small[3] == P - 1 + 3)
        assert_everywhere(world, bool(ok and ring.native.posted == (5 if P > 1 else 0)), "in-flight latency path")


def test_ranks_must_agree_on_the_crossover(world):
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    with pytest.raises(CollectiveMismatchError, match=r"latency_bytes for allreduce \(rank 0: 4096, rank 1: 0"):
        Ring(world, latency_bytes=4096 if world.Get_rank() == 0 else 0)
