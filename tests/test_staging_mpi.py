"""The staged gradient path (GPU models) on CPU under MPITRAIN_STAGING=force: every strategy stays exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from dp_helpers import wrap
from runtime import STRATEGIES, DistributedOptimizer
from runtime.device import STAGING_ENV
from test_transparency_mpi import LOCAL_BATCH, Attention, Edgy, close, data, train

pytestmark = pytest.mark.mpi


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv(STAGING_ENV, "force")


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_staged_equals_single_process(world, forced, strategy):
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y)
    assert_everywhere(world, close(train(strategy, world, X, Y), reference), f"staged {strategy} differs")


@pytest.mark.parametrize("strategy", ["allreduce", "p3"])
def test_staged_with_pto_and_adam(world, forced, strategy):
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y, adam=True)
    got = train(strategy, world, X, Y, adam=True, pto=True)
    assert_everywhere(world, close(got, reference), f"staged {strategy} + pto differs")


def test_staged_p3_gates_weights_read_by_a_parent(world, forced):
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y, make=Attention)
    assert_everywhere(world, close(train("p3", world, X, Y, 5, make=Attention), reference), "attention")


def edgy(world):
    """The transparency tests' edge-case model (seeded) and every step's data."""
    torch.manual_seed(0)
    return (Edgy(), *data(world.Get_size()))


def local_backward(world, model, X, Y, step: int) -> None:
    """This rank's share of the step's batch, forward and backward."""
    r = world.Get_rank()
    x, y = X[step][r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH], Y[step][r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH]
    nn.functional.cross_entropy(model(x), y).backward()


def test_every_gradient_goes_out_and_back_once_per_step(world, forced):
    model, X, Y = edgy(world)
    n = sum(p.requires_grad for p in model.parameters())
    with wrap(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05), model, "wfbp") as dopt:
        for step in range(3):
            dopt.zero_grad()
            local_backward(world, model, X, Y, step)
            dopt.synchronize()
            averaged = [p.grad.clone() for p in model.parameters() if p.requires_grad]
            for p in model.parameters():  # what the user does between synchronize() and step() stays
                if p.grad is not None:
                    p.grad.mul_(0.5)
            before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
            dopt.step()
        staging, buckets = dopt.staging, len(dopt.strategy.bucket_params)
        # A bucket at a time: one copy (its slice of the flat buffer) and one hand-over per bucket, not per parameter.
        ok = (staging is not None and staging.copies_to_host == staging.batches_to_host == 3 * buckets < 3 * n
              and staging.outstanding.count(False) == n and "staged" in dopt.transport
              and dopt.buffers.flats[0].data_ptr() != dopt.buffers.device_flats[0].data_ptr())
        # Every bucket's average went back as its allreduce completed, on the progress thread; none at the update.
        ok = ok and staging.copies_to_device == staging.copies_as_averaged > 0
        # The last step's update used the halved average: p_new = p - lr * g / 2.
        after = [p.detach() for p in model.parameters() if p.requires_grad]
        ok = ok and all(torch.allclose(a, b - 0.05 * g * 0.5, atol=1e-7) for a, b, g in zip(after, before, averaged))
    assert_everywhere(world, ok, "staging copies or post-synchronize edits wrong")


@pytest.mark.parametrize("strategy", ["allreduce", "p3", "hybcomm"])
def test_gradients_go_to_the_host_in_groups_not_one_by_one(world, forced, strategy):
    """Strategies without buckets of their own: neighbouring gradients go out together (about a megabyte a
    group), one copy and one hand-over to the staging thread each: here the whole small model at once."""
    model, X, Y = edgy(world)
    with wrap(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05), model, strategy) as dopt:
        for step in range(2):
            dopt.zero_grad()
            local_backward(world, model, X, Y, step)
            dopt.step()
        staging = dopt.staging
        ok = len(staging.groups) == 1 and staging.batches_to_host == 2 and staging.copies_to_host == 2 * len(
            staging._ranges[0])
    assert_everywhere(world, ok, f"{strategy}: gradients must go to the host a group at a time")


def test_staged_allreduce_in_pieces_equals_single_process(world, forced, monkeypatch):
    """Staged, allreduce runs piece by piece and sends each piece's average back as it completes (the early
    copy-back), not all of it after the last byte; still synchronous SGD."""
    from runtime.dense import AllreduceSync

    monkeypatch.setattr(AllreduceSync, "piece_bytes", 200)  # Edgy's 11 x 13 weight alone, neighbours together
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y)
    assert_everywhere(world, close(train("allreduce", world, X, Y), reference), "staged allreduce in pieces differs")
    model, X, Y = edgy(world)
    n = sum(p.requires_grad for p in model.parameters())
    with wrap(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05), model, "allreduce") as \
            dopt:
        for step in range(2):
            dopt.zero_grad()
            local_backward(world, model, X, Y, step)
            dopt.step()
        staging, pieces = dopt.staging, dopt.strategy.pieces
        ok = 1 < len(pieces) < n and sorted(i for idxs, _ in pieces for i in idxs) == list(range(n))
        ok = ok and staging.copies_to_device == staging.copies_as_averaged == 2 * len(pieces)
    assert_everywhere(world, ok, "staged allreduce must send each piece back as it completes")


def test_p3_sends_each_tensors_average_back_as_its_last_slice_returns(world, forced):
    """p3's tensors complete on its progress thread: each one's copy back is made there, before any layer's
    forward waits for it, and the training thread's gates copy nothing."""
    model, X, Y = edgy(world)
    with wrap(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05), model, "p3") as dopt:
        for step in range(3):
            dopt.zero_grad()
            local_backward(world, model, X, Y, step)
            dopt.step()
        model(X[0][:LOCAL_BATCH])  # the last step's updates, through the gates
        staging = dopt.staging
        ok = staging.copies_to_device == staging.copies_as_averaged > 0 and not any(staging.outstanding)
    assert_everywhere(world, ok, "p3's averages must go back as they complete")


def test_p3_sends_averages_back_slice_by_slice_within_a_large_tensor(world, forced, monkeypatch):
    """With copies of at most a slice (BACK_BYTES below one), each slice's average goes back as it lands, once a
    step: a tensor of many slices is not copied whole when its last one lands, and training stays exact."""
    from runtime.p3 import copy_back

    monkeypatch.setattr(copy_back, "BACK_BYTES", 1)
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y)
    assert_everywhere(world, close(train("p3", world, X, Y), reference), "staged p3, slice by slice, differs")
    model, X, Y = edgy(world)
    with wrap(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05), model, "p3",
              slice_size=7) as dopt:
        for step in range(3):
            dopt.zero_grad()
            local_backward(world, model, X, Y, step)
            dopt.step()
        model(X[0][:LOCAL_BATCH])  # the last step's updates, through the gates
        staging, plan = dopt.staging, dopt.strategy.exchange.plan
        spans = max(len(ids) for ids in plan.slices_of)
        ok = spans > 1 and staging.copies_to_device == staging.copies_as_averaged == 3 * plan.count
        ok = ok and not any(staging.outstanding)
    assert_everywhere(world, ok, "p3 must send each slice's average back as it lands")


def test_ranks_staging_differently_are_named(world, monkeypatch):
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    from mpicomm import CollectiveMismatchError

    if world.Get_rank() == 1:
        monkeypatch.setenv(STAGING_ENV, "force")
    model = nn.Linear(3, 2)
    with pytest.raises(CollectiveMismatchError, match=r"rank 1: device cpu, staged=True"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, "wfbp")


def test_unstaged_cpu_model_shares_its_memory(world):
    model = nn.Linear(3, 2)
    with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, "allreduce") as dopt:
        ok = dopt.staging is None and dopt.transport == "host memory" and \
            dopt.buffers.flats[0].data_ptr() == dopt.buffers.device_flats[0].data_ptr()
    assert_everywhere(world, ok, "a CPU model must not be staged by default")


