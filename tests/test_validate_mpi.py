"""Ranks that disagree get the same clear error on every rank, never a hang."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpicomm import BufferError, CollectiveMismatchError, Ring, TagError

pytestmark = pytest.mark.mpi


@pytest.fixture
def ring(world):
    r = Ring(world, validate=True)
    yield r
    r.free()


def test_different_lengths_named_by_rank(world, ring):
    n = 100 + (world.Get_rank() == 1)
    with pytest.raises(CollectiveMismatchError, match=r"disagree on length \(rank 0: 100, rank 1: 101"):
        ring.allreduce(np.ones(n, np.float32)).wait()
    # The ring is still usable afterwards: no half-sent messages were left behind.
    x = np.ones(10, np.float32)
    ring.allreduce(x).wait()
    assert np.all(x == world.Get_size())


def test_different_dtypes(world, ring):
    dtype = np.float64 if world.Get_rank() == world.Get_size() - 1 else np.float32
    with pytest.raises(CollectiveMismatchError, match="disagree on dtype"):
        ring.allreduce(np.ones(64, dtype)).wait()


def test_different_collectives(world, ring):
    x = np.ones(64, np.float32)
    h = (lambda: ring.broadcast(x)) if world.Get_rank() == 0 else (lambda: ring.allreduce(x))
    with pytest.raises(CollectiveMismatchError, match="ranks called different collectives"):
        h().wait()


def test_different_roots_and_ops(world, ring):
    x = np.ones(8, np.float32)
    with pytest.raises(CollectiveMismatchError, match="disagree on root"):
        ring.broadcast(x, root=world.Get_rank() % 2).wait()
    with pytest.raises(CollectiveMismatchError, match="disagree on op"):
        ring.allreduce(x, op="max" if world.Get_rank() == 0 else "sum").wait()


def test_non_contiguous_on_one_rank(world, ring):
    """The offending rank gets the precise reason, the others learn which rank it was."""
    base = torch.ones(16, 16)
    bad = world.Get_rank() == 2 % world.Get_size()
    x = base.t() if bad else base
    expected = (BufferError, "non-contiguous") if bad else (CollectiveMismatchError, r"rank\(s\) \[2\]")
    with pytest.raises(expected[0], match=expected[1]):
        ring.allreduce(x).wait()


def test_unsupported_dtype_and_bad_tag_on_one_rank(world, ring):
    x = np.ones(4, np.complex64) if world.Get_rank() == 0 else np.ones(4, np.float32)
    with pytest.raises((BufferError, CollectiveMismatchError), match="unsupported dtype|invalid argument"):
        ring.allreduce(x).wait()
    tag = ring.tags.ub + 1 if world.Get_rank() == 0 else 5
    with pytest.raises((TagError, CollectiveMismatchError), match="TAG_UB|invalid argument"):
        ring.allreduce(np.ones(4, np.float32), tag=tag).wait()


def test_allgatherv_counts_disagree(world, ring):
    P, r = world.Get_size(), world.Get_rank()
    counts = [3] * P
    if r == 0:
        counts[-1] = 4  # rank 0 believes the last rank sends one more
    x = np.ones(3, np.float32)
    with pytest.raises(CollectiveMismatchError, match="block lengths|length"):
        ring.allgatherv(x, counts=counts).wait()


def test_allgatherv_counts_given_on_some_ranks_only(world, ring):
    """A rank given counts sends its fingerprint while the others exchange lengths: one collective, named."""
    P, r = world.Get_size(), world.Get_rank()
    x = np.full(3, r, np.float32)
    with pytest.raises(CollectiveMismatchError, match=r"every rank passes counts or none does \(rank 0: "
                                                      r"allgatherv, rank 1: allgatherv, no counts"):
        ring.allgatherv(x, counts=[3] * P if r == 0 else None).wait()
    out = ring.allgatherv(x).wait()  # the ring is still usable, lengths exchanged
    assert np.array_equal(out, np.repeat(np.arange(P, dtype=np.float32), 3))


def test_wrong_out_size_reported_everywhere(world, ring):
    r = world.Get_rank()
    out = np.empty(65 if r == 1 else 64, np.float32)
    with pytest.raises((BufferError, CollectiveMismatchError), match="out has 65|invalid argument"):
        ring.allreduce(np.ones(64, np.float32), out).wait()


def test_validate_off_still_rejects_local_problems_everywhere(world):
    """Without validation a problem every rank shares is still a clear local error."""
    with Ring(world, validate=False) as ring:
        with pytest.raises(BufferError, match="non-contiguous"):
            ring.allreduce(np.ones((4, 4), np.float32).T).wait()
        with pytest.raises(ValueError, match="unsupported op"):
            ring.allreduce(np.ones(4, np.float32), op="mean").wait()
        x = np.ones(5, np.float32)
        ring.allreduce(x).wait()
        assert np.all(x == world.Get_size())


def test_env_switches_validation_off(world, monkeypatch):
    monkeypatch.setenv("MPITRAIN_VALIDATE", "0")
    with Ring(world) as ring:
        assert ring.validate is False
    monkeypatch.setenv("MPITRAIN_VALIDATE", "1")
    with Ring(world) as ring:
        assert ring.validate is True
