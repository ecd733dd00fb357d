"""The strategy protocol from outside the package: a registered strategy sees layer factors (what SFB needs)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from dp_helpers import Branchy, batches, close, local, max_diff, sgd, train
from runtime import DistributedOptimizer, StrategyOptions
from runtime.dense import AllreduceSync
from runtime.registry import register_strategy

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


@dataclass(frozen=True)
class FactorCheckOptions(StrategyOptions):
    name = "factor-check"


class FactorCheck(AllreduceSync):
    """Allreduce, and before averaging, rebuilds each Linear's weight gradient from its captured factors."""

    name = "factor-check"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.capture = [m for m in ctx.model.modules() if isinstance(m, nn.Linear)]
        self.products: dict = {}
        self.checked = self.mismatches = 0

    def captured(self, k, inputs, grad_output):
        u = inputs.reshape(-1, inputs.shape[-1])
        d = grad_output.reshape(-1, grad_output.shape[-1])
        self.products[k] = d.T @ u  # sum over rows of rank-one outer products: the weight gradient

    def finish(self, used, full=False):
        for k, module in enumerate(self.capture):
            if k in self.products:
                self.checked += 1
                self.mismatches += not torch.allclose(self.products.pop(k), module.weight.grad, atol=1e-6)
        super().finish(used, full)


register_strategy("factor-check", FactorCheck)


def test_registered_strategy_receives_sufficient_factors(world):
    X, Y = batches(world.Get_size(), steps=4)
    torch.manual_seed(7)
    model = Branchy()
    dopt = DistributedOptimizer(sgd(model), model, FactorCheckOptions())
    r = world.Get_rank()
    for step in range(4):
        dopt.zero_grad()
        nn.functional.cross_entropy(model(local(X[step], r), step % 3), local(Y[step], r)).backward()
        dopt.step()
    strategy = dopt.strategy
    dopt.close()
    # paths 0, 1, 2, 0: inp and head every step, a or b in three of them: factors arrived and rebuilt every gradient.
    assert_everywhere(world, strategy.checked == 11 and strategy.mismatches == 0,
                      f"checked {strategy.checked}, mismatches {strategy.mismatches}")
    want = train(world, "allreduce", Branchy, lambda s, q: s % 3, X, Y, steps=4)
    got = [p.detach() for p in model.parameters()]
    assert_everywhere(world, close(got, want), f"max difference {max_diff(got, want):.3g}")
