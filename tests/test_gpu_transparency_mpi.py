"""On CUDA, every exact strategy (and PTO) is still synchronous SGD: ranks sharing one GPU equal one process."""

from __future__ import annotations

import pytest
import torch
from test_transparency_mpi import close, data, train

from conftest import assert_everywhere
from runtime import STRATEGIES

pytestmark = [pytest.mark.mpi, pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")]


@pytest.fixture
def device(world):
    """This rank's GPU as the jobs pick it (local rank % GPUs): 4 ranks on one GPU share it."""
    from jobs.common.devices import rank_device
    from mpicomm import Topology

    with Topology(world) as topo:
        return rank_device("cuda", topo)


@pytest.mark.parametrize("pto", [False, True], ids=["plain", "pto"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_equals_single_process_on_whole_batch(world, device, strategy, pto):
    """20 steps of a small model in float32, 4 ranks on CUDA = one process on CUDA on the whole batch (1e-5)."""
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y, device=device)
    got = train(strategy, world, X, Y, device=device, pto=pto)
    assert_everywhere(world, close(got, reference), f"{strategy}{' + pto' if pto else ''} on {device} differs "
                                                    "from one process on the whole batch")
    assert_everywhere(world, not close(got, train(None, world, X[:, :1], Y[:, :1], device=device)),
                      "test cannot fail")
