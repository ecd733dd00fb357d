"""Which of ShardedUpdate's parameters sit in which param group of the optimizer, and whether one was written."""

from __future__ import annotations

import torch


def group_members(optimizer, params) -> list[list[int]]:
    """Per param group, the indices into `params` of its parameters in `params` order; raise on a mismatch."""
    index = {}
    for i, p in enumerate(params):
        if id(p) in index:
            raise ValueError(f"parameter #{i} appears twice in params (tied weights must be listed once)")
        index[id(p)] = i
    if not params:
        raise ValueError("ShardedUpdate needs at least one parameter")
    members, seen = [], set()
    for gi, g in enumerate(optimizer.param_groups):
        idx = []
        for p in g["params"]:
            if id(p) not in index and not p.requires_grad:
                continue  # a frozen parameter: no gradient, never updated, as in the unsharded step
            if id(p) not in index:
                raise ValueError(f"param group {gi} of the optimizer holds a parameter of shape {tuple(p.shape)} "
                                 "that is not in ShardedUpdate's params")
            idx.append(index[id(p)])
        members.append(sorted(idx))
        seen.update(idx)
    missing = [i for i in range(len(params)) if i not in seen]
    if missing:
        raise ValueError(f"params #{missing} (shapes {[tuple(params[i].shape) for i in missing]}) are in no param "
                         "group of the optimizer: every parameter ShardedUpdate updates must be in exactly one")
    return members


def group_layout(optimizer) -> tuple:
    """Which parameter objects sit in which group, cheap to compare every step."""
    return tuple(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups)


def identity(p: torch.Tensor) -> tuple[int, int]:
    """Storage and version counter: equal as long as nothing wrote to the parameter in place or replaced it."""
    return p.data_ptr(), p._version
