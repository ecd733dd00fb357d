"""Start-up broadcast: every rank ends with root's values, whatever the tensors' sizes, dtypes and layouts."""

from __future__ import annotations

import pytest
import torch

from mpicomm.agree import DIRECT_BYTES, broadcast_tensors
from conftest import assert_everywhere

pytestmark = pytest.mark.mpi


def tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    big = DIRECT_BYTES // 4 + 3  # float32 elements: sent in place
    last = torch.randn(4, 8, 16, 16, generator=g)
    # On rank 1 the large 4-d tensor is channels_last: a layout of its own must not change the traffic.
    last = last.to(memory_format=torch.channels_last) if rank == 1 else last
    return [
        torch.randn(big, generator=g),
        torch.randn(big // 2, generator=g, dtype=torch.float64),
        torch.randn(5, 3, generator=g),  # small: packed
        torch.randn(7, generator=g, dtype=torch.float64),
        torch.randint(0, 100, (9,), generator=g),
        torch.randn(3, 4, generator=g).t(),  # small and transposed
        last,
        torch.empty(0),
        torch.randn(6, generator=g) > 0,
    ]


@pytest.mark.parametrize("root", [0, 1])
def test_every_rank_gets_roots_values(world, root):
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    mine, expected = tensors(world.Get_rank()), tensors(root)
    strides = [t.stride() for t in mine]
    broadcast_tensors(world, mine, root=root)
    for k, (t, e, s) in enumerate(zip(mine, expected, strides)):
        assert_everywhere(world, torch.equal(t, e), f"tensor {k} differs from root's on rank {world.Get_rank()}")
        assert_everywhere(world, t.stride() == s, f"tensor {k} changed layout")
