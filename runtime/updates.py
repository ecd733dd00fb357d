"""Run the wrapped optimizer's step on chosen parameters only, with the hyper-parameters of a given step."""

from __future__ import annotations

import torch


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every param group's settings except its parameters (what a deferred update must remember)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def describe_hyper(hyper: list[dict]) -> list[str]:
    """'group 0 lr=0.05' lines, comparable across ranks (tensors as their values)."""
    lines = []
    for gi, h in enumerate(hyper):
        for k in sorted(h):
            v = h[k]
            if torch.is_tensor(v):
                v = v.tolist()
            lines.append(f"group {gi} {k}={v!r}")
    return lines


class ParamUpdater:
    """`step(indices, hyper)`: optimizer.step() over just those parameters.

    The optimizer's param groups are swapped, for the duration of the call,
    for copies holding only the chosen parameters and the given settings; the
    optimizer's state dict is untouched, so its per-parameter state (momentum,
    Adam's moments and step counts) is the one it always uses. A parameter
    left out is exactly as if its .grad were None: not updated, state not
    advanced. Per-layer updates (p3) thus cost what the layer costs, not a
    pass over the whole model.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]):
        self.optimizer = optimizer
        where = {id(p): i for i, p in enumerate(params)}
        self.group_of = [None] * len(params)
        for gi, g in enumerate(optimizer.param_groups):
            for p in g["params"]:
                i = where.get(id(p))
                if i is not None:
                    self.group_of[i] = gi
        self.params = params
        self._cache: dict = {}
        self.stepping = False  # inside step(): the optimizer's step is ours, not a user's call (guard_step)

    def _groups(self, indices: tuple) -> list[list]:
        groups = self._cache.get(indices)
        if groups is None:
            groups = [[] for _ in self.optimizer.param_groups]
            for i in indices:
                if self.group_of[i] is not None:  # a trainable parameter the optimizer was not given
                    groups[self.group_of[i]].append(self.params[i])
            if len(self._cache) < 4096:  # the usual keys: every parameter, one per gated layer
                self._cache[indices] = groups
        return groups

    def step(self, indices, hyper: list[dict] | None = None) -> None:
        indices = tuple(indices)
        if not indices:
            return
        opt = self.optimizer
        groups = self._groups(indices)
        hyper = hyper or hyperparameters(opt)
        saved = opt.param_groups
        opt.param_groups = [dict(h, params=ps) for h, ps in zip(hyper, groups) if ps]
        self.stepping = True
        try:
            opt.step()
        finally:
            opt.param_groups = saved
            self.stepping = False

    def guard_step(self, wrapper: str):
        """A step pre-hook on the optimizer (its handle returned) that refuses a step() not made by this updater:
        a loop calling the wrapped optimizer's own step() would update with this rank's gradients, unaveraged."""
        def refuse(optimizer, args, kwargs):
            if not self.stepping:
                raise RuntimeError(f"step() was called on the {type(optimizer).__name__} that {wrapper} wraps: it "
                                   f"would update with this rank's own gradients, not their average. Call step() "
                                   f"on the {wrapper} (it averages, then updates)")
        return self.optimizer.register_step_pre_hook(refuse)
