"""Pipeline bad input on 4 ranks: a clear error on every rank, never a hang."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_everywhere
from test_agreement_mpi import raised_everywhere
from test_pipeline_mpi import build, data, sgd
from runtime.pipeline import Pipeline

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def needs_four(world):
    if world.Get_size() != 4:
        pytest.skip("4 stages")


def make(**kw):
    args = dict(loss_fn=F.cross_entropy, balance=[2, 2, 2, 1], microbatches=2, mode="flush")
    args.update(kw)
    return Pipeline(args.pop("model", None) or build(), args.pop("factory", sgd), **args)


def test_fewer_layers_than_stages(world):
    raised_everywhere(world, lambda: make(balance=None, stages=8, sample=torch.randn(2, 12)),
                      "PipelineError", "8 stages need at least 8 layers; the model has 7")


def test_balance_that_does_not_cover_the_model(world):
    raised_everywhere(world, lambda: make(balance=[2, 2, 2]), "PipelineError", r"balance \[2, 2, 2\] covers 6 layers, "
                      "the model has 7")


def test_world_not_divisible_into_stages_and_replicas(world):
    needs_four(world)
    raised_everywhere(world, lambda: make(balance=[3, 2, 2]), "4 ranks cannot run 3 stages x 1 replicas")


def test_model_that_is_not_sequential(world):
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return x + self.a(x)

    raised_everywhere(world, lambda: make(model=Residual()), "PipelineError", "Residual is not sequential")
    raised_everywhere(world, lambda: make(model=[nn.Linear(2, 2), "relu"]), "layer 1 is a str, not an nn.Module")


@pytest.mark.parametrize("factory,why", [(lambda ps: torch.optim.Adam(ps), "Adam has none"),
                                         (lambda ps: torch.optim.SGD(ps, lr=0.1), "momentum > 0")])
def test_spectrain_needs_a_momentum_optimizer(world, factory, why):
    needs_four(world)
    raised_everywhere(world, lambda: make(mode="spectrain", factory=factory), "PipelineError",
                      "spectrain predicts weights from SGD's momentum buffer", why)


def test_one_rank_configured_differently_is_named(world):
    needs_four(world)
    mode = "stash" if world.Get_rank() == 1 else "flush"
    raised_everywhere(world, lambda: make(mode=mode), "CollectiveMismatchError", "rank 1: mode=stash",
                      "rank 0, 2, 3: mode=flush")


def test_layers_that_cannot_take_the_first_inputs(world):
    needs_four(world)
    pipe = make()
    x, y = data(1, 8)[0][0]

    def step():
        pipe.train_step(torch.randn(8, 7), y)  # the first Linear takes 12 features
    raised_everywhere(world, step, "stage 0: RuntimeError", "shapes cannot be multiplied")


def test_inputs_of_another_shape_later_stop_every_rank(world):
    needs_four(world)
    pipe = make(mode="stash")
    (x, y), = data(1, 8)[0]

    def step():  # stage 0 runs ahead: the others may still be in the first step when it fails
        pipe.train_step(x, y)
        pipe.train_step(torch.randn(16, 12), torch.randint(0, 5, (16,)))
    raised_everywhere(world, step, "inputs of micro-batch shape \\(8, 12\\) float32, but the pipeline was set up "
                                   "for \\(4, 12\\) float32")


def test_ranks_stepping_a_different_number_of_times(world):
    needs_four(world)
    pipe = make(mode="vanilla")
    steps = data(3, 8)

    def run():
        for parts in steps[:3 if world.Get_rank() == 3 else 2]:
            pipe.train_step(*parts[0])
        pipe.close()
    raised_everywhere(world, run, "CollectiveMismatchError", "ranks are at different points")


def test_evaluate_with_another_batch_size_on_one_rank_is_named(world):
    """Each stage sizes its receives from its own batch_size: agreed first, or one rank's receive would be
    truncated and its neighbour would wait."""
    needs_four(world)
    pipe = make()
    (x, y), = data(1, 8)[0]
    pipe.train_step(x, y)
    size = 4 if world.Get_rank() == 1 else 8
    raised_everywhere(world, lambda: pipe.evaluate(x, y, batch_size=size), "CollectiveMismatchError",
                      "rank 1: batch_size=4", "rank 0, 2, 3: batch_size=8")


@pytest.mark.parametrize("mode", ["flush", "vanilla"])  # vanilla: evaluate() drains the backward passes owed
def test_a_rank_still_training_while_the_others_evaluate_is_named(world, mode):
    needs_four(world)
    pipe = make(mode=mode)
    steps = data(2, 8)
    pipe.train_step(*steps[0][0])

    def run():
        if world.Get_rank() == 2:
            pipe.train_step(*steps[1][0])
        else:
            pipe.evaluate(*steps[1][0], batch_size=4)
    raised_everywhere(world, run, "CollectiveMismatchError", "ranks are at different points",
                      r"evaluate\(\) after 1 steps", "rank 2: step #2")


def test_evaluate_refuses_a_batch_size_below_one_on_every_rank(world):
    needs_four(world)
    pipe = make()
    (x, y), = data(1, 8)[0]
    pipe.train_step(x, y)
    raised_everywhere(world, lambda: pipe.evaluate(x, y, batch_size=0), "batch_size must be a whole number >= 1")


def test_a_stage_failing_inside_evaluate_stops_the_others_in_their_waits(world):
    """The last stage's loss refuses the targets: it raises there, and the other stages, waiting for the scores'
    broadcast or a batch, raise its error in place (not ended later by fail-stop's watcher)."""
    needs_four(world)
    pipe = make()
    (x, y), = data(1, 8)[0]
    pipe.train_step(x, y)
    raised_everywhere(world, lambda: pipe.evaluate(x, y[:4], batch_size=8), "Expected input batch_size \\(8\\) "
                      "to match target batch_size \\(4\\)")


def test_evaluate_without_inputs_on_the_first_stage_stops_every_stage(world):
    needs_four(world)
    pipe = make()
    (x, y), = data(1, 8)[0]
    pipe.train_step(x, y)
    # The others raise their own "no inputs to count", or stage 0's error where its notice came first.
    message = raised_everywhere(world, lambda: pipe.evaluate(None, y, batch_size=8), "evaluate\\(\\): ",
                                "first stage")
    assert_everywhere(world, world.Get_rank() != 0 or "inputs must be a tensor" in message, message)
