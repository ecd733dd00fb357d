"""Which of a model's buffers runtime.model_buffers keeps equal across ranks (no MPI: the simulator reads it too)."""

from __future__ import annotations

import torch

__all__ = ["synced_buffers"]


def synced_buffers(model: torch.nn.Module, mode: str = "average") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(sent, watched): the floating-point buffers BufferSync sends every step, and those it only watches.

    Integer buffers (num_batches_tracked) advance alike on every rank and
    are neither. Under "average", a buffer registered with persistent=False
    (not part of the model's state: a constant or a cache, such as the
    Transformer's positions) is watched: equal on every rank since the
    wrapper's broadcast, it is sent only from the step in which it changes
    on some rank. Under "broadcast" every floating-point buffer is sent.
    """
    if mode == "none":
        return [], []
    persistent: dict[int, bool] = {}
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None:  # a buffer registered persistent anywhere is state
                persistent[id(b)] = persistent.get(id(b), False) or name not in module._non_persistent_buffers_set
    floating = [b for b in model.buffers() if b.is_floating_point() and b.numel()]
    if mode != "average":
        return floating, []
    return [b for b in floating if persistent[id(b)]], [b for b in floating if not persistent[id(b)]]
