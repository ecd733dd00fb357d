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


def test_the_indices_go_into_the_kept_buffer_given_as_int64():
    n = 100
    out = torch.zeros(n)
    idx = torch.tensor([5, 1, 9], dtype=torch.int32)
    block = pack(torch.tensor([1.0, 2.0, 3.0]), idx)
    kept = torch.full((6,), -1, dtype=torch.int64)
    got = scatter_add(out, torch.cat([block, block]), [block.numel()] * 2, torch.float32, kept)
    assert got is kept and kept.tolist() == [5, 1, 9, 5, 1, 9] and out[[5, 1, 9]].tolist() == [2.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="applied must be 3 x int64"):
        scatter_add(out, block, [block.numel()], torch.float32, torch.empty(4, dtype=torch.int64))
