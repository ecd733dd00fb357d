"""Top-k's arguments checked (density, k, the tensor, the index dtype), and the exact reference (torch.topk)."""

from __future__ import annotations

import math

import numpy as np
import torch

INDEX_DTYPES = (torch.int64, torch.int32)


def check_density(density: float, what: str = "density") -> float:
    density = float(density)
    if not 0 < density <= 1:  # also rejects NaN
        raise ValueError(f"{what} must be in (0, 1], got {density!r}")
    return density


def k_for_density(numel: int, density: float) -> int:
    """max(1, ceil(density * numel)), without float fuzz turning 0.07 * 100 into 8."""
    if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel < 1:
        raise ValueError(f"numel must be a positive integer, got {numel!r}")
    density = check_density(density)
    p = density * numel
    k = round(p) if abs(p - round(p)) <= 1e-9 * p else math.ceil(p)
    return int(min(numel, max(1, k)))


def check_topk(x: torch.Tensor, k: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"top-k needs a floating-point tensor, got dtype {x.dtype}")
    if x.numel() == 0:
        raise ValueError("cannot select top-k from an empty tensor")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be an integer, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if k > x.numel():
        raise ValueError(f"k={k} is larger than the tensor ({x.numel()} elements)")


def check_index_dtype(index_dtype: torch.dtype) -> None:
    if index_dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype must be torch.int64 or torch.int32, got {index_dtype}")


def exact_topk(x: torch.Tensor, k: int, index_dtype: torch.dtype = torch.int64):
    """Reference: torch.topk of |x| over the flattened tensor, as (signed values, indices)."""
    check_topk(x, k)
    check_index_dtype(index_dtype)
    flat = x.detach().reshape(-1)
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    return flat[idx], idx.to(index_dtype)
