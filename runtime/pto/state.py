"""Optimizer state as PTO reshards it: per-element state, scalars, values compared across ranks, host settings."""

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


def host_hyper(group: dict) -> dict:
    """A param group's hyper-parameters (or an optimizer's defaults) for the host-side optimizer.

    Without "params", and with `capturable` off: it keeps the step count on
    the device for CUDA graphs, and torch refuses it for host tensors; the
    update is the same without it.
    """
    hyper = {k: v for k, v in group.items() if k != "params"}
    if hyper.get("capturable"):
        hyper["capturable"] = False
    return hyper


def placed_like_optimizer(key, value: torch.Tensor, p: torch.Tensor, group: dict) -> torch.Tensor:
    """Scalar state where the user's optimizer keeps it: the "step" of a capturable or fused group on the
    parameter's device in float32, as torch's load_state_dict puts it; anything else as it is."""
    if key == "step" and (group.get("capturable") or group.get("fused")):
        return value.to(device=p.device, dtype=torch.float32)
    return value
