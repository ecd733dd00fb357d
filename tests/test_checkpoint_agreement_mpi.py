"""Checkpoints mid-run: called on one rank only they name it on every rank (no hang); weights loaded under p3
are not undone by the update still owed."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from mpicomm import CollectiveMismatchError
from runtime import DistributedOptimizer, load_checkpoint, save_checkpoint

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def build(world, strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, strategy,
                               comm=world)
    return model, opt


def step(model, opt, world):
    opt.zero_grad()
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(world.Get_rank()))).sum().backward()
    opt.step()


@pytest.mark.parametrize("call", ["save_checkpoint", "state_dict", "load_state_dict"])
def test_a_checkpoint_on_one_rank_only_is_named_on_every_rank(world, tmp_path_factory, call):
    """`if rank == 0: save_checkpoint(...)`, the habit of other frameworks: rank 0 waited in the state's gather
    until the stall limit (600 s) while the others stepped on; now every rank raises, naming both."""
    path = os.path.join(str(tmp_path_factory.getbasetemp()), "c.pt")  # one base per rank: rank 0's alone
    model, opt = build(world, "p3")
    with pytest.raises(CollectiveMismatchError) as err:
        for s in range(4):
            step(model, opt, world)
            if s == 1 and world.Get_rank() == 0:
                if call == "save_checkpoint":
                    save_checkpoint(path, model, opt)
                elif call == "state_dict":
                    opt.state_dict()
                else:
                    opt.load_state_dict(None)
    said = str(err.value)
    assert_everywhere(world, "rank 0: a checkpoint after 2 steps" in said and "step #3" in said, said)
    opt.abort(err.value)


def test_every_rank_checkpointing_still_works_and_a_call_apart_is_named(world, tmp_path_factory):
    path = os.path.join(str(tmp_path_factory.mktemp("ck")), "c.pt")
    path = world.bcast(path, root=0)
    model, opt = build(world, "allreduce")
    step(model, opt, world)
    save_checkpoint(path, model, opt, epoch=3)
    assert_everywhere(world, load_checkpoint(path, model, opt) == {"epoch": 3})
    with pytest.raises(CollectiveMismatchError) as err:
        opt.state_dict() if world.Get_rank() == 0 else opt.load_state_dict(None)
    said = str(err.value)
    assert_everywhere(world, "call=state_dict()" in said and "call=load_state_dict()" in said, said)
    opt.abort(err.value)


@pytest.mark.parametrize("strategy", ["p3", "allreduce"])
def test_weights_loaded_mid_run_are_the_weights_the_next_forward_sees(world, strategy):
    """A best model kept aside and loaded back: under p3 the update owed from the last step was applied on top
    of the loaded weights by the next forward (up to 3.95 away); now it lands before the load."""
    model, opt = build(world, strategy)
    try:
        step(model, opt, world)
        best = copy.deepcopy(model.state_dict())
        for _ in range(3):
            step(model, opt, world)
        model.load_state_dict(best)
        model(torch.zeros(1, 8))  # p3's forward gate: applies whatever is owed
        far = max((p - best[n]).abs().max().item() for n, p in model.named_parameters())
        assert_everywhere(world, far == 0.0, far)
    finally:
        opt.close()
