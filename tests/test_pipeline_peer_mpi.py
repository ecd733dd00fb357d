"""jobs.bench.pipeline_peer: torch's pipeline schedules over gloo train as one process would, and report a rate."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_everywhere
from jobs.bench.pipeline_peer import LAYERS, even_balance, model_layers, run_peer
from runtime.workloads.models import build_model, loss_fn, model_input

HIDDEN = [64, 64, 64]  # Flatten, 3 x (Linear, ReLU), Linear: 8 layers
BATCH, MICRO, WARMUP, STEPS, LR, MOMENTUM = 32, 4, 1, 3, 0.05, 0.9


def make_batch(step: int):
    """A different global batch each step, the same on every rank."""
    (x,), y = model_input("mlp", BATCH, seed=100 + step)
    return x, y


def whole_mlp() -> list:
    torch.manual_seed(0)
    return model_layers(build_model("mlp", hidden=HIDDEN))


def one_process(steps: int) -> tuple[list, float]:
    """(layers, last step's loss) after `steps` momentum-SGD steps on the whole model, loss = mean over the batch."""
    layers = whole_mlp()
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for i in range(steps):
        x, y = make_batch(i)
        opt.zero_grad()
        loss = loss_fn("mlp")(model(x), y)
        loss.backward()
        opt.step()
    return layers, loss.item()


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stages_equal_one_process_sgd(world, schedule):
    torch.set_num_threads(1)
    n, rank = world.Get_size(), world.Get_rank()
    layers = whole_mlp()
    balance = even_balance(len(layers), n)
    row = run_peer(layers, balance, loss_fn("mlp"), make_batch, microbatches=MICRO, schedule=schedule,
                   warmup=WARMUP, steps=STEPS, lr=LR, momentum=MOMENTUM, comm=world)
    ref, ref_loss = one_process(WARMUP + STEPS)
    a = sum(balance[:rank])
    mine = [p for m in layers[a:a + balance[rank]] for p in m.parameters()]
    theirs = [p for m in ref[a:a + balance[rank]] for p in m.parameters()]
    worst = max((float((p - q).detach().abs().max()) for p, q in zip(mine, theirs)), default=0.0)
    initial = [p for m in whole_mlp()[a:a + balance[rank]] for p in m.parameters()]
    moved = all(not torch.equal(p, q) for p, q in zip(mine, initial))
    assert_everywhere(world, len(mine) == len(theirs) and worst < 1e-5 and moved,
                      f"rank {rank}: {len(mine)} vs {len(theirs)} tensors, max |diff| {worst:.3g}, moved {moved}")
    assert abs(row["loss"] - ref_loss) < 1e-5, (row["loss"], ref_loss)
    assert row["samples_per_s"] > 0 and row["t_iter_s"] > 0 and row["ci"] >= 0
    assert (row["stages"], row["batch"], row["microbatches"], row["schedule"]) == (n, BATCH, MICRO, schedule)
    # Each boundary sends its [BATCH, width] float32 activation forward and its gradient back.
    widths = [784, 64, 64, 64, 64, 64, 64, 10]  # output width of each layer
    ends = [sum(balance[:i + 1]) - 1 for i in range(n - 1)]
    assert row["activation_bytes_per_step"] == sum(2 * BATCH * widths[e] * 4 for e in ends)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_counts_are_the_models(name):
    """The job checks --balance against LAYERS before torch starts: it must match runtime.workloads.models."""
    with torch.device("meta"):
        assert len(model_layers(build_model(name))) == LAYERS[name]


def test_even_balance():
    assert even_balance(9, 4) == [2, 2, 2, 3]
    assert even_balance(8, 4) == [2, 2, 2, 2]
    assert even_balance(43, 4) == [10, 11, 11, 11]
