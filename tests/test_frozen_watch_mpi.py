"""A layer frozen when the optimizer was wrapped and unfrozen later: refused at the next step, every rank told."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from runtime import DistributedOptimizer, ParametersChangedError, PeerFailedError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


@pytest.mark.parametrize("strategy", ["allreduce", "p3"])
def test_unfreezing_after_wrapping_is_refused_naming_the_parameters(world, strategy):
    """Gradual unfreezing under one wrapper: the unfrozen layer's gradients were neither averaged nor applied
    (it stayed where it was on every rank, no error); now step() raises, naming it, where it is unfrozen (here
    rank 0 only: the others hear of it, as of any failure)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model[0].requires_grad_(False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy, comm=world)
    with pytest.raises((ParametersChangedError, PeerFailedError)) as err:
        for s in range(4):
            if s == 2 and world.Get_rank() == 0:
                model[0].requires_grad_(True)
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    said = str(err.value)
    assert_everywhere(world, "0.weight, 0.bias: frozen (requires_grad=False) when the optimizer was wrapped" in said,
                      said)
    assert_everywhere(world, isinstance(err.value, ParametersChangedError) == (world.Get_rank() == 0))
