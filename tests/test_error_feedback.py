"""Error feedback residuals and the density schedule, in one process."""

from __future__ import annotations

import pytest
import torch

from mpicomm.sparse_pairs import pack, unpack
from runtime.sparse.error_feedback import DensitySchedule, ErrorFeedback
from runtime.sparse.selection import k_for_density as k_for


def exact(x, k):
    idx = torch.topk(x.abs(), k).indices
    return x[idx], idx


def test_schedule_warmup_then_ramp_then_target():
    s = DensitySchedule(0.001, warmup_steps=2, ramp_steps=4, start=0.25)
    got = [s(i) for i in range(8)]
    assert got[:2] == [1.0, 1.0] and s.dense(1) and not s.dense(2)
    assert got[2] == pytest.approx(0.25)
    assert all(a > b for a, b in zip(got[2:6], got[3:7]))  # strictly falling during the ramp
    assert got[6] == got[7] == 0.001


def test_schedule_without_warmup_is_constant():
    s = DensitySchedule(0.01)
    assert [s(i) for i in range(3)] == [0.01] * 3 and not s.dense(0)


@pytest.mark.parametrize("bad", [0, -1, 1.01, float("nan")])
def test_schedule_rejects_bad_density(bad):
    with pytest.raises(ValueError, match="density must be in"):
        DensitySchedule(bad)


def test_schedule_rejects_negative_steps():
    with pytest.raises(ValueError, match="must be >= 0"):
        DensitySchedule(0.1, warmup_steps=-1)


def test_k_for_bounds():
    assert k_for(1000, 0.001) == 1 and k_for(1000, 0.0001) == 1 and k_for(10, 1.0) == 10 and k_for(999, 0.01) == 10


def test_residual_keeps_exactly_what_was_not_sent():
    ef = ErrorFeedback(exact)
    g = torch.Generator().manual_seed(0)
    given, sent = torch.zeros(500, dtype=torch.float64), torch.zeros(500, dtype=torch.float64)
    for _ in range(10):
        x = torch.randn(500, generator=g, dtype=torch.float64)
        given += x
        v, i = ef.select("w", x, 0.02)
        assert v.numel() == 10
        sent.index_add_(0, i, v)
    assert torch.allclose(sent + ef.residual("w"), given, atol=1e-12)


def test_residual_lets_small_entries_through_eventually():
    """A constant small gradient is never top-k alone, but its residual grows until it is."""
    ef = ErrorFeedback(exact)
    x = torch.tensor([1.0, 0.3])
    picked = [int(ef.select("w", x.clone(), 0.5)[1][0]) for _ in range(6)]
    assert 1 in picked


def test_disabled_feedback_drops_the_rest():
    ef = ErrorFeedback(exact, enabled=False)
    v, i = ef.select("w", torch.tensor([3.0, -5.0, 1.0]), 0.33)
    assert i.tolist() == [1] and v.tolist() == [-5.0] and ef.residual("w") is None


def test_residual_state_round_trip():
    ef = ErrorFeedback(exact)
    ef.select("w", torch.arange(6.0), 0.5)
    other = ErrorFeedback(exact)
    other.load_state_dict(ef.state_dict())
    assert torch.equal(other.residual("w"), ef.residual("w"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pack_unpack_round_trip(dtype):
    v, i = torch.tensor([1.5, -2.0, 3.25], dtype=dtype), torch.tensor([7, 0, 3])
    got_v, got_i = unpack(pack(v, i), dtype)
    assert torch.equal(got_v, v) and got_i.tolist() == [7, 0, 3]


def test_pack_rejects_two_byte_values():
    with pytest.raises(TypeError, match="4- or 8-byte"):
        pack(torch.ones(2, dtype=torch.float16), torch.tensor([0, 1]))
