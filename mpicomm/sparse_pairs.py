"""(index, value) pairs as one packed byte block, and every rank's blocks summed into a dense vector."""

from __future__ import annotations

import torch

INDEX_DTYPES = {4: torch.int32, 8: torch.int64}  # index width follows the value width: one packed buffer


def pack(values: torch.Tensor, indices: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(values, indices) as one byte tensor [indices | values], indices stored at the values' width."""
    k, width = values.numel(), values.element_size()
    if width not in INDEX_DTYPES:
        raise TypeError(f"sparse allreduce needs 4- or 8-byte values, got {values.dtype}")
    if out is None:
        out = torch.empty(2 * k * width, dtype=torch.uint8)
    out[:k * width].view(INDEX_DTYPES[width]).copy_(indices)
    out[k * width:].view(values.dtype).copy_(values)
    return out


def unpack(packed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack`: (values, indices) views of one packed block."""
    width = torch.empty(0, dtype=dtype).element_size()
    k = packed.numel() // (2 * width)
    return packed[k * width:].view(dtype), packed[:k * width].view(INDEX_DTYPES[width])


def scatter_add(out: torch.Tensor, gathered: torch.Tensor, blocks: list[int], dtype: torch.dtype,
                applied: torch.Tensor | None = None) -> torch.Tensor:
    """Add the packed (index, value) blocks, of these byte sizes, into the dense `out`; returns their indices.

    The blocks are summed in rank order, the same on every rank, so every
    rank ends with bit-identical sums. Within a block the indices are
    distinct (one selection's positions), so index_add_ adds each value once,
    as index_put_(accumulate=True) would, without the sort that the latter
    makes on a GPU to order repeated indices. The indices are returned as
    int64 (what index_fill_ takes) in `applied` where given: a kept buffer of
    every block's pairs on out's device, so that no call allocates them.
    """
    n = sum(blocks) // (2 * dtype.itemsize)
    if applied is None:
        applied = torch.empty(n, dtype=torch.int64, device=out.device)
    elif applied.numel() != n or applied.dtype != torch.int64 or applied.device != out.device:
        raise ValueError(f"applied must be {n} x int64 on {out.device}, got {applied.numel()} x {applied.dtype} "
                         f"on {applied.device}")
    start = at = 0
    for size in blocks:
        if size:
            vals, idx = unpack(gathered[start:start + size], dtype)
            out.index_add_(0, idx, vals)  # int32 indices as they came: no int64 copy of each block
            applied[at:at + idx.numel()].copy_(idx)
            at += idx.numel()
        start += size
    return applied
