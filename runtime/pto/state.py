"""Optimizer state as PTO reshards it: per-element state, scalars, and values compared across ranks."""

from __future__ import annotations

import torch


def laid_out_like(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per-element state laid out like its parameter (a checkpoint may hold it contiguous)."""
    if value.stride() == p.stride():
        return value.detach()
    out = torch.empty_like(p, dtype=value.dtype)
    out.copy_(value.detach().view(p.shape))
    return out


def state_kind(value, numel: int) -> str:
    """'elem' for per-element state of a 1-d piece of `numel` elements, 'scalar' for a number, else 'other'."""
    if torch.is_tensor(value):
        if value.dim() == 1 and value.numel() == numel:
            return "elem"
        return "scalar" if value.dim() == 0 else "other"
    return "scalar" if isinstance(value, (int, float)) else "other"


def same_value(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b
