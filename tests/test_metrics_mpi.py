"""opt.sum_over_ranks: metrics summed over ranks, agreed like a step, so a rank elsewhere is named on every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from mpicomm import CollectiveMismatchError
from runtime import DistributedOptimizer

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def optimizer(world):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, "allreduce",
                                       comm=world)


def step(model, opt):
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()


def test_sums_numbers_arrays_and_tensors_on_every_rank(world):
    model, opt = optimizer(world)
    r, P = world.Get_rank(), world.Get_size()
    try:
        step(model, opt)
        counts = opt.sum_over_ranks([r, 1])
        assert_everywhere(world, isinstance(counts, np.ndarray) and counts.tolist() == [P * (P - 1) // 2, P])
        loss = opt.sum_over_ranks(torch.tensor([0.5 * r], dtype=torch.float64))
        assert_everywhere(world, torch.is_tensor(loss) and loss.item() == 0.5 * P * (P - 1) / 2)
        assert_everywhere(world, opt.sum_over_ranks(np.full((2, 3), r)).tolist() == [[P * (P - 1) // 2] * 3] * 2)
        with pytest.raises(TypeError):
            opt.sum_over_ranks(["a"])  # refused on each rank before anything collective: nothing to agree
        step(model, opt)  # the steps go on after it
    finally:
        opt.close()


def test_a_rank_a_step_behind_is_named_with_its_step(world):
    model, opt = optimizer(world)
    behind = world.Get_size() - 1
    with pytest.raises(CollectiveMismatchError) as err:
        for _ in range(2 if world.Get_rank() == behind else 3):
            step(model, opt)
        opt.sum_over_ranks([1.0])
    assert_everywhere(world, f"rank {behind}: sum_over_ranks() after 2 steps" in str(err.value), str(err.value))
    opt.abort(err.value)


def test_values_of_another_shape_are_named(world):
    model, opt = optimizer(world)
    with pytest.raises(CollectiveMismatchError) as err:
        opt.sum_over_ranks(np.zeros(2 + (world.Get_rank() == 1)))
    assert_everywhere(world, "sum_over_ranks of float64 (3,)" in str(err.value), str(err.value))
    opt.abort(err.value)


def test_booleans_are_counted_and_narrow_integers_do_not_wrap(world):
    """pred == y summed: MPI has no SUM for bools (a raw MPI error on one rank before), int8 wrapped (-56 for
    100 + 100 on 2 ranks); a 0-d value comes back 0-d."""
    model, opt = optimizer(world)
    P = world.Get_size()
    try:
        step(model, opt)
        hits = opt.sum_over_ranks(torch.tensor([True, False, True]))
        assert_everywhere(world, hits.tolist() == [P, 0, P], hits)
        small = opt.sum_over_ranks(np.array([100], dtype=np.int8))
        assert_everywhere(world, small.tolist() == [100 * P], small)
        one = opt.sum_over_ranks(np.float64(1.5))
        assert_everywhere(world, one.shape == () and float(one) == 1.5 * P, one)
    finally:
        opt.close()
