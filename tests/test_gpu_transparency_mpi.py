"""On CUDA, every exact strategy (and PTO) is still synchronous SGD: ranks sharing one GPU equal one process."""

from __future__ import annotations

import pytest
import torch
from test_transparency_mpi import ZEROINGS, close, data, train, zeroing_loop

from conftest import assert_everywhere
from runtime import STRATEGIES

pytestmark = [pytest.mark.mpi, pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")]


@pytest.mark.parametrize("pto", [False, True], ids=["plain", "pto"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_equals_single_process_on_whole_batch(world, device, strategy, pto):
    """20 steps of a small model in float32, 4 ranks on CUDA = one process on CUDA on the whole batch (1e-5)."""
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y, device=device)
    got = train(strategy, world, X, Y, device=device, pto=pto)
    assert_everywhere(world, close(got, reference), f"{strategy}{' + pto' if pto else ''} on {device} differs "
                                                    "from one process on the whole batch")
    assert_everywhere(world, not close(got, train(None, world, X[:, :1], Y[:, :1], device=device)),
                      "test cannot fail")


@pytest.mark.parametrize("zeroing", ZEROINGS)
def test_p3_under_a_loop_zeroing_not_through_the_wrapper_equals_one_process(world, device, zeroing):
    """On CUDA, p3's .grad placeholders between step() and each update (sparse, on the device) take the loop's
    zeroing, in place or not, and its own tensors; the averages copied back to the device stay for the update."""
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y, device=device)
    got, unrouted = zeroing_loop(world, X, Y, "p3", zeroing, device)
    assert_everywhere(world, close(got, reference) and unrouted, f"p3 on {device}, the loop zeroing through the "
                                                                 f"{zeroing}, differs from one process")


# ----------------------------------------------------------------------------- the waits, under delays

DELAY_CYCLES = 40_000_000  # torch.cuda._sleep: ~20-40 ms at 1-2 GHz, far longer than any copy here
WIDE, CLASSES, DELAYED_STEPS, DELAYED_BATCH = 2048, 10, 4, 8


class Delay(torch.autograd.Function):
    """Identity; its backward first sleeps on the stream backward runs on: the gradients of the layers
    below are produced that much later than their hooks fire on the host."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if grad.is_cuda:
            torch.cuda._sleep(DELAY_CYCLES)
        return grad


class Wide(torch.nn.Module):
    """16 MiB weights: each copy to or from the host takes milliseconds (a missing wait reads stale values)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(64, WIDE)
        self.mid = torch.nn.Linear(WIDE, WIDE)
        self.mid2 = torch.nn.Linear(WIDE, WIDE)
        self.out = torch.nn.Linear(WIDE, CLASSES)

    def forward(self, x):
        h = Delay.apply(torch.tanh(self.inp(x)))
        h = Delay.apply(torch.tanh(self.mid(h)))
        return self.out(torch.tanh(self.mid2(h)))


def wide_train(strategy, world, device, local=DELAYED_BATCH):
    """DELAYED_STEPS SGD steps of Wide; strategy None: one process on the whole batch. Under a strategy the
    staging's side streams sleep before every backward: copies to the host, and back, start late."""
    from dp_helpers import wrap

    g = torch.Generator().manual_seed(99)
    P, r = world.Get_size(), world.Get_rank()
    X = torch.randn(DELAYED_STEPS, DELAYED_BATCH * P, 64, generator=g).to(device)
    Y = torch.randint(0, CLASSES, (DELAYED_STEPS, DELAYED_BATCH * P), generator=g).to(device)
    torch.manual_seed(3)
    model = Wide().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dopt = wrap(opt, model, strategy) if strategy else opt
    staging = getattr(dopt, "staging", None)
    for step in range(DELAYED_STEPS):
        x, y = X[step], Y[step]
        x, y = (x[r * local:(r + 1) * local], y[r * local:(r + 1) * local]) if strategy else (x[:local * P],
                                                                                               y[:local * P])
        dopt.zero_grad()
        if staging is not None and staging.cuda:
            # Copies to the host start a quarter delay in (before most gradients exist: each must wait for its
            # own); copies back start after four (long after backward: the update must wait for them).
            for side, cycles in ((staging.stream, DELAY_CYCLES // 4), (staging.back_stream, 4 * DELAY_CYCLES)):
                with torch.cuda.stream(side):
                    torch.cuda._sleep(cycles)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        dopt.step()
    if strategy:
        model(X[0][:1])  # p3: the last step's updates, through its gates
        ok = staging is not None and staging.batches_to_host < DELAYED_STEPS * len(list(model.parameters()))
        dopt.close()
        assert ok, "gradients must go to the host a bucket at a time"
    return [p.detach().cpu().clone() for p in model.parameters()]


@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "p3"])
def test_every_wait_holds_under_delays_on_the_compute_and_side_streams(world, device, strategy):
    """A model whose copies take milliseconds, its backward delayed on the compute stream and the staging's
    side streams delayed too: a copy that did not wait for its gradient, a hand-over that did not wait for its
    copy, or an update that did not wait for the copies back would read stale values and differ."""
    reference = wide_train(None, world, device)
    got = wide_train(strategy, world, device)
    tol = dict(rtol=1e-4, atol=1e-5)
    assert_everywhere(world, all(torch.allclose(a, b, **tol) for a, b in zip(got, reference)),
                      f"{strategy} on {device} under delays differs from one process on the whole batch")
    half = wide_train(None, world, device, local=DELAYED_BATCH // 2)
    assert_everywhere(world, not all(torch.allclose(a, b, **tol) for a, b in zip(half, reference)),
                      "test cannot fail")


def test_p3_carries_cuda_batchnorm_statistics_and_every_rank_averages_them(world, device):
    """On CUDA, p3 packs the BatchNorm statistics in its first gradient hook (the autograd thread) and carries
    them in its exchange: after each step every rank holds the mean over ranks of what each held at step()."""
    import torch.nn as nn
    from mpi4py import MPI

    from runtime import DistributedOptimizer

    r, P = world.Get_rank(), world.Get_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).to(device)
    bn = model[1]
    dopt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, "p3")
    g = torch.Generator().manual_seed(5)
    worst = 0.0
    for _ in range(3):
        x = (torch.randn(8, 6, generator=g) + 2 * r).to(device)
        y = torch.randint(0, 3, (8,), generator=g).to(device)
        dopt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        held = torch.cat([bn.running_mean, bn.running_var]).double().cpu().numpy()
        world.Allreduce(MPI.IN_PLACE, held)
        dopt.step()
        dopt.synchronize()
        got = torch.cat([bn.running_mean, bn.running_var]).double().cpu().numpy()
        worst = max(worst, float(abs(got - held / P).max()))
    carried = dopt.model_buffers.carrier is dopt.strategy or P == 1
    dopt.close()
    assert_everywhere(world, worst < 1e-5 and carried, f"worst difference {worst:g}; carried by p3: {carried}")
