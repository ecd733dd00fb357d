"""Wrapping's first steps: its arguments checked, the settings agreed across ranks, rank 0's state broadcast."""

from __future__ import annotations

import torch

from mpicomm.agree import broadcast_tensors, check_same_structure

from .model_buffers import MODES as BUFFER_MODES


def check_arguments(backward_passes_per_step, comm, topology, buffers: str) -> None:
    """DistributedOptimizer's own arguments, checked on this rank before anything collective."""
    bpps = backward_passes_per_step
    if not isinstance(bpps, int) or isinstance(bpps, bool) or bpps < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {bpps!r}")
    if comm is not None and topology is not None:
        raise ValueError("pass comm or topology, not both")
    if buffers not in BUFFER_MODES:
        raise ValueError(f"buffers must be one of {BUFFER_MODES}, got {buffers!r}")


def check_settings(comm, settings: list[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective, first: a rank with other settings would go on to create other communicators and hang.

    Compares the settings, the optimizer's groups, every parameter (name,
    shape, dtype, trainable or frozen; strides too where trainable) and every
    buffer; the error names the first difference and which ranks hold which
    value.
    """
    entries = list(settings)
    entries.append(f"optimizer {type(optimizer).__name__} groups={[len(g['params']) for g in optimizer.param_groups]}")
    # Frozen parameters too: broadcast_from_root sends every parameter, and one that differs in shape
    # or dtype would give a raw MPI error there, or a hang. Strides only where trainable: the gradient
    # buffers are laid out after them, while the broadcast copies any layout.
    entries += [f"parameter {n} {tuple(p.shape)} {p.dtype} " + (f"trainable strides={p.stride()}" if p.requires_grad
                                                                else "frozen")
                for n, p in model.named_parameters()]
    entries += [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in model.named_buffers()]
    check_same_structure(comm, entries, "setting")
    in_model = {id(p) for p in model.parameters()}
    foreign = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if id(p) not in in_model]
    if foreign:
        raise ValueError(f"the optimizer holds parameters that are not in the model (shapes {foreign[:4]}): "
                         "they would be updated without being synchronised")


def broadcast_from_root(comm, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Rank 0's parameters, buffers and optimizer state tensors on every rank (collective)."""
    state = optimizer.state_dict()["state"]  # references to the live state tensors, written in place
    tensors = [v for k in sorted(state) for _, v in sorted(state[k].items()) if torch.is_tensor(v) and v.dim()]
    check_same_structure(comm, [f"{tuple(t.shape)} {t.dtype}" for t in tensors], "optimizer state tensor")
    with torch.no_grad():
        broadcast_tensors(comm, [p.detach() for p in model.parameters()] + list(model.buffers()) + tensors)
