"""Emulated gradients' fixed values: a cache-resident block of Gaussian values times a scale per row."""

# So that landing a large gradient writes host memory without reading a second copy as large, and no copy of it is kept.

from __future__ import annotations

import math

import torch

__all__ = ["ROW", "LARGE", "firsts", "fixed", "template", "write"]

ROW = 1 << 16  # elements in the block: 256 KB in fp32, which stays in a core's L2 while a gradient is written
# A parameter at least this large keeps its row scales (p._emulated_rows) and lands by write(): on this VM that
# writes 548 MB (VGG-19's gradients) in ~24 ms where a copy from a full-size template takes ~37 ms, because a
# copy also reads as many bytes from memory. A GPU's staging copy only writes host memory (its DMA engine reads
# the device's). Smaller ones are copied from their template, in one foreach call for all of them. A LARGE one
# keeps no template (p._emulated_grad is None): VGG19-22K's would be 916 MB more a rank, which 8 ranks on this
# VM's 23.5 GiB cannot hold beside the parameters and gradients; fixed(p) makes it where a whole one is needed.
LARGE = 4 * ROW
_SEED = 20261126
_blocks: dict[torch.dtype, torch.Tensor] = {}


def _block(dtype: torch.dtype) -> torch.Tensor:
    b = _blocks.get(dtype)
    if b is None:
        b = _blocks[dtype] = torch.randn(ROW, generator=torch.Generator().manual_seed(_SEED)).to(dtype)
    return b


def template(p: torch.nn.Parameter, g: torch.Generator) -> torch.Tensor:
    """p's fixed gradient: the block, row after row, each row times its own scale (uniform in 0.5-1.5 times one
    that falls with fan-in, as real gradients' magnitudes do). Never zero, and no two rows alike, so top-k has
    something to pick. Where p is LARGE: sets p._emulated_rows (the scales), from which write() lands it, and
    returns None (no template is kept: fixed(p) makes one)."""
    fan_in = p[0].numel() if p.dim() > 1 else p.numel()
    rows = -(-p.numel() // ROW)
    scales = (torch.rand(rows, 1, generator=g) + 0.5).mul_(1e-2 / math.sqrt(max(1, fan_in))).to(p.dtype)
    if p.numel() >= LARGE:
        p._emulated_rows = scales
        return None
    t = torch.empty(p.shape, dtype=p.dtype)
    write(t, scales)
    return t


def fixed(p: torch.nn.Parameter) -> torch.Tensor:
    """p's fixed gradient as a tensor of p's shape: its template, or, for a LARGE one, a new tensor written from
    its row scales (an allocation: for a first gradient, or a caller that needs the whole tensor)."""
    t = p._emulated_grad
    if t is None:
        t = torch.empty(p.shape, dtype=p.dtype)
        write(t, p._emulated_rows)
    return t


def firsts(p: torch.nn.Parameter) -> torch.Tensor:
    """The first value of each row of p's fixed gradient (its flat view's [::ROW]), without the whole of it."""
    if p._emulated_grad is not None:
        return p._emulated_grad.view(-1)[::ROW].clone()
    return torch.mul(_block(p.dtype)[0], p._emulated_rows.view(-1))  # write()'s product for each row's first


def write(dst: torch.Tensor, scales: torch.Tensor) -> None:
    """The fixed gradient whose row scales these are, written into dst (contiguous, of its size): one broadcast
    multiply for the whole rows, one for the rest, each value the same as its template's (same operation)."""
    flat, block = dst.view(-1), _block(dst.dtype)
    full = flat.numel() // ROW
    if full:
        torch.mul(block, scales[:full], out=flat[:full * ROW].view(full, ROW))
    rest = flat.numel() - full * ROW
    if rest:
        torch.mul(block[:rest], scales[full], out=flat[full * ROW:])
