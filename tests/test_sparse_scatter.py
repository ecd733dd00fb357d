"""The sum of every rank's (index, value) pairs: index_add_ per block gives index_put_(accumulate=True)'s bits."""

from __future__ import annotations

import pytest
import torch

from mpicomm.sparse_pairs import pack, scatter_add


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scatter_add_equals_accumulating_index_put_bit_for_bit(dtype):
    """Four ranks' selections (distinct positions within each, overlapping between them), summed in rank order
    into a vector that already holds values: the same bits as index_put_(accumulate=True), the former kernel."""
    g = torch.Generator().manual_seed(7)
    n, k = 5000, 700
    start = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    blocks, packed = [], []
    for _ in range(4):
        idx = torch.randperm(n, generator=g)[:k]  # one rank's top k: distinct positions
        vals = (torch.randn(k, generator=g, dtype=torch.float64) * 1e3).to(dtype)  # sums that round
        block = pack(vals, idx)
        packed.append(block)
        blocks.append(block.numel())
    got = start.clone()
    applied = scatter_add(got, torch.cat(packed), blocks, dtype)
    want = start.clone()
    for block in packed:
        vals, idx = block[block.numel() // 2:].view(dtype), block[:block.numel() // 2].view(
            torch.int32 if dtype == torch.float32 else torch.int64)
        want.index_put_((idx.long(),), vals, accumulate=True)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(got, start)  # something was added
    assert applied.numel() == 4 * k
