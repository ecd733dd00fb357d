"""Which module's forward pass must wait for which parameters, learned from the first forward pass."""

from __future__ import annotations

import torch


class ForwardGate:
    """Forward pre-hooks on every module; after `freeze()`, module m's hook calls `on_enter(params gated by m)`.

    A parameter is gated by the module that holds it, or, when that module's
    own forward never runs (nn.MultiheadAttention reads out_proj.weight
    directly), by its nearest ancestor that does. A parameter no running
    module holds falls back to the root, which runs first. Priorities follow
    the order in which gating modules first ran: earlier layers first.
    """

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter], on_enter):
        self.on_enter = on_enter
        named = list(model.named_modules())
        self.names = [n for n, _ in named]
        index = {id(p): i for i, p in enumerate(params)}
        self.holder = [None] * len(params)  # module position first holding each parameter
        for pos, (_, module) in enumerate(named):
            for p in module.parameters(recurse=False):
                i = index.get(id(p))
                if i is not None and self.holder[i] is None:
                    self.holder[i] = pos
        self.order: list[int] = []
        self._ran: set[int] = set()
        self.gate: dict[int, list[int]] | None = None
        self.priority: list[int] = [0] * len(params)
        self.handles = [m.register_forward_pre_hook(self._hook(pos)) for pos, (_, m) in enumerate(named)]

    def _hook(self, pos: int):
        def pre_hook(module, inputs):
            if self.gate is None:
                if pos not in self._ran:
                    self._ran.add(pos)
                    self.order.append(pos)
            else:
                owed = self.gate.get(pos)
                if owed:
                    self.on_enter(owed)
        return pre_hook

    def freeze(self) -> list[int]:
        """Fix the gates from what the forward passes so far ran; returns the per-parameter priorities."""
        pos_of = {name: pos for pos, name in enumerate(self.names)}
        rank = {pos: k for k, pos in enumerate(self.order)}
        self.gate = {}
        for i, holder in enumerate(self.holder):
            name = self.names[holder] if holder is not None else ""
            gate = None
            while True:
                pos = pos_of[name]
                if pos in self._ran and (name or holder == 0):
                    gate = pos
                    break
                if not name:
                    break
                name = name.rpartition(".")[0]
            if gate is None:
                gate = 0  # the root: always runs first
                self.priority[i] = -1  # and wait as little as possible there
            else:
                self.priority[i] = rank[gate]
            self.gate.setdefault(gate, []).append(i)
        return self.priority

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
