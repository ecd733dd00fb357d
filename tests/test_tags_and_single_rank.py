"""Tags against TAG_UB, and every collective on one rank (COMM_SELF) with its handle semantics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpicomm import IN_PLACE, BufferError, Ring, TagAllocator, TagError, check_tag, slice_tag
from mpicomm.tags import end_tag, explicit_tag_bound


def test_tag_bounds():
    ub = MPI.COMM_SELF.Get_attr(MPI.TAG_UB)
    top = explicit_tag_bound(MPI.COMM_SELF)
    assert check_tag(MPI.COMM_SELF, 0) == 0 and check_tag(MPI.COMM_SELF, top) == top == ub // 2
    for bad in (-1, top + 1, ub, 1.5, True):
        with pytest.raises(TagError, match="TAG_UB"):
            check_tag(MPI.COMM_SELF, bad)


def test_automatic_tags_live_above_the_explicit_ones_and_wrap_below_the_end_tag():
    """The top tag is never handed out: mpicomm.quiesce's end markers carry it."""
    tags = TagAllocator(MPI.COMM_SELF)
    first = explicit_tag_bound(MPI.COMM_SELF) + 1
    assert [tags.next() for _ in range(3)] == [first, first + 1, first + 2]
    tags._next = tags.ub - 1
    assert tags.next() == tags.ub - 1 == end_tag(MPI.COMM_SELF) - 1 and tags.next() == first


def test_slice_tags_distinct_and_checked():
    seen = {slice_tag(MPI.COMM_SELF, t, s, 8) for t in range(5) for s in range(8)}
    assert len(seen) == 40
    with pytest.raises(TagError):
        slice_tag(MPI.COMM_SELF, 0, 8, 8)
    with pytest.raises(TagError, match="TAG_UB"):
        slice_tag(MPI.COMM_SELF, 10**9, 0, 8)


def test_every_collective_on_one_rank():
    with Ring(MPI.COMM_SELF) as ring:
        x = np.arange(7, dtype=np.float32)
        out = np.empty_like(x)
        h = ring.allreduce(x, out)
        assert h.done and h.test() and h.wait() is out and np.array_equal(out, x)
        rs = np.empty(7, np.float32)
        assert np.array_equal(ring.reduce_scatter(x, rs).wait(), x)
        assert np.array_equal(ring.allgather(x).wait(), x)
        assert np.array_equal(ring.allgatherv(x).wait(), x)
        g = np.zeros(7, np.float32)
        g[:] = x
        assert np.array_equal(ring.allgather(IN_PLACE, g).wait(), x)
        t = torch.ones(3)
        assert ring.broadcast(t).wait() is t


def test_local_errors_are_raised_on_one_rank_too():
    with Ring(MPI.COMM_SELF) as ring:
        with pytest.raises(BufferError, match="out has 3"):
            ring.allreduce(np.ones(4, np.float32), np.ones(3, np.float32)).wait()
        with pytest.raises(ValueError, match="root 1 outside"):
            ring.broadcast(np.ones(4, np.float32), root=1).wait()
        with pytest.raises(ValueError, match="IN_PLACE needs an out"):
            ring.allgather(IN_PLACE).wait()
        with pytest.raises(ValueError, match="chunk_bytes"):
            Ring(MPI.COMM_SELF, chunk_bytes=0)


def test_crossover_from_argument_environment_or_crossover_file(tmp_path, monkeypatch):
    """latency_bytes: an int, a per-kind dict, $MPITRAIN_RING_LATENCY_BYTES as bytes or a bench's JSON."""
    from mpicomm.native import DEFAULT_LATENCY_BYTES, ENV

    def table(**kw):
        with Ring(MPI.COMM_SELF, **kw) as ring:
            return ring.latency_bytes

    monkeypatch.delenv(ENV, raising=False)
    assert table() == DEFAULT_LATENCY_BYTES
    assert table(latency_bytes=0)["allreduce"] == 0
    assert table(latency_bytes={"broadcast": 5}) == {**DEFAULT_LATENCY_BYTES, "broadcast": 5}
    monkeypatch.setenv(ENV, "64K")
    assert set(table().values()) == {65536} and table(latency_bytes=7)["allreduce"] == 7
    path = tmp_path / "crossover.json"
    path.write_text('{"latency_bytes": {"allreduce": 1048576, "allgather": 0}, "meta": {}}')
    monkeypatch.setenv(ENV, str(path))
    t = table()
    assert t == {**DEFAULT_LATENCY_BYTES, "allreduce": 1 << 20, "allgather": 0}
    (tmp_path / "bad.json").write_text('{"allreduce": 4}')
    for bad, match in (("4Q", "neither a byte count"), (str(tmp_path / "missing.json"), "existing crossover JSON"),
                       (str(tmp_path), "not a crossover JSON"), (str(tmp_path / "bad.json"), "'latency_bytes' object")):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=match):
            Ring(MPI.COMM_SELF)
    monkeypatch.delenv(ENV)
    for bad, match in ((-1, ">= 0"), ({"alltoall": 4}, "unknown collective"), ("4M", ">= 0")):
        with pytest.raises(ValueError, match=match):
            Ring(MPI.COMM_SELF, latency_bytes=bad)
