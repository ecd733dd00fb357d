"""hybcomm takes each layer's factors to the host on the thread that runs backward, not on the communication threads."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from runtime import DistributedOptimizer, HybCommOptions

pytestmark = pytest.mark.mpi

FAST_LINK = dict(bandwidth=1e9, gflops=1e6)  # a slow link, free arithmetic: bytes decide


def model_and_sgd():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(108, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 5))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batches(P, sizes):
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(P * n, 108, generator=g), torch.randint(0, 5, (P * n,), generator=g)) for n in sizes]


def test_factors_are_copied_on_the_thread_that_runs_backward(world):
    """Ranks other than 0 start backward late, so rank 0's census completes on the progress thread, which then
    starts its layers: the rows must already be on the host, copied in the layers' hooks by the training thread
    (on a GPU a copy there waits for the device and stalls every message the thread drives)."""
    r, P = world.Get_rank(), world.Get_size()
    model, opt = model_and_sgd()
    with DistributedOptimizer(opt, model, HybCommOptions(force="sfb"), comm=world) as dopt:
        for x, y in batches(P, [4, 4, 4]):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[r * 4:(r + 1) * 4]), y[r * 4:(r + 1) * 4])
            if r:
                time.sleep(0.3)
            loss.backward()
            dopt.step()
        threads = set().union(*(ex.copy_threads for ex in dopt.strategy.exchanges))
        sent = dopt.strategy.traffic["sfb"]
    assert_everywhere(world, threads == {threading.main_thread().name} and sent > 0,
                      f"factors copied on {sorted(threads)}")


def test_a_layer_that_turns_sfb_copies_its_rows_when_it_starts(world):
    """Large batches send the first layer PS, small ones SFB: in the step where the plan turns, backward kept
    references (the last plan said PS) and the layer copies them as it starts. Still one process's SGD."""
    r, P = world.Get_rank(), world.Get_size()
    sizes = [40, 40, 2, 2, 40, 2]
    data = batches(P, sizes)
    model, opt = model_and_sgd()
    choices = []
    with DistributedOptimizer(opt, model, HybCommOptions(**FAST_LINK), comm=world) as dopt:
        for (x, y), n in zip(data, sizes):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[r * n:(r + 1) * n]), y[r * n:(r + 1) * n]).backward()
            dopt.step()
            choices.append(dopt.strategy.plan[0].choice)
    got = [p.detach().clone() for p in model.parameters()]
    model, opt = model_and_sgd()
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, model.parameters()))
    assert_everywhere(world, choices == ["ps", "ps", "sfb", "sfb", "ps", "sfb"], f"plans {choices}")
    assert_everywhere(world, ok, "hybcomm whose plan turns differs from one process")


# -- a CUDA model: 4 ranks may share one GPU ----------------------------------------------------
class Late(torch.autograd.Function):
    """Identity whose backward first keeps the current stream busy: the output gradient is final late."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time on the stream backward runs on
        return grad * 1.0


class Wide(nn.Module):
    """A conv (the dense path) and Linear layers whose output gradients arrive late on the GPU."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 5, padding=2)
        self.fc1, self.fc2, self.head = nn.Linear(4 * 108, 512), nn.Linear(512, 512), nn.Linear(512, 5)

    def forward(self, x):
        h = torch.tanh(self.conv(x[:, None, :])).flatten(1)
        h = Late.apply(torch.tanh(self.fc1(h)))
        h = Late.apply(torch.tanh(self.fc2(h)))
        return self.head(h)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
@pytest.mark.parametrize("dense", ["wfbp", "p3"])
def test_cuda_model_on_a_user_stream_with_forced_sfb_is_one_process(world, dense):
    """Forced SFB on a GPU, forward and backward on a stream of the user's, the output gradients delayed on it:
    the factors are read after they are final (one process's SGD), and never copied on the staging or progress
    thread."""
    from jobs.common.devices import rank_device
    from mpicomm import Topology

    with Topology(world) as topo:
        device = rank_device("cuda", topo)
    r, P, n = world.Get_rank(), world.Get_size(), 8
    data = batches(P, [n] * 4)
    stream = torch.cuda.Stream(device)

    def wide_and_sgd():
        torch.manual_seed(3)
        model = Wide().to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, opt = wide_and_sgd()
    with DistributedOptimizer(opt, model, HybCommOptions(force="sfb", dense=dense), comm=world) as dopt:
        stream.wait_stream(torch.cuda.current_stream(device))  # the broadcast parameters, before training reads them
        with torch.cuda.stream(stream):
            for x, y in data:
                x, y = x[r * n:(r + 1) * n].to(device), y[r * n:(r + 1) * n].to(device)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                dopt.step()
            dopt.synchronize()
        stream.synchronize()
        threads = set().union(*(ex.copy_threads for ex in dopt.strategy.exchanges))
        plan = {c.name: c.choice for c in dopt.strategy.plan}
    got = [p.detach().cpu() for p in model.parameters()]
    model, opt = wide_and_sgd()
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
    ok = all(torch.allclose(a, b.detach().cpu(), rtol=1e-4, atol=1e-5) for a, b in zip(got, model.parameters()))
    err = max((a - b.detach().cpu()).abs().max().item() for a, b in zip(got, model.parameters()))
    assert_everywhere(world, plan == {"fc1": "sfb", "fc2": "sfb", "head": "sfb"}, f"plan {plan}")
    # Backward's hooks run on autograd's thread for the device; mpitrain-*: the staging and progress threads.
    assert_everywhere(world, bool(threads) and not any(t.startswith("mpitrain-") for t in threads),
                      f"copied on {threads}")
    assert_everywhere(world, ok, f"hybcomm forced SFB on {device} (dense {dense}) differs from one process by up to {err:.3g}")
