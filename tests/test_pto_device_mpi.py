"""PTO around a device's optimizer: capturable Adam, averages read where the strategy left them, copies back."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_transparency_mpi import LOCAL_BATCH, STEPS, Edgy, close, data, steps

from conftest import assert_everywhere
from dp_helpers import wrap
from runtime.device import STAGING_ENV

pytestmark = pytest.mark.mpi
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")

# Not the defaults: every one of them must reach the host-side optimizer.
ADAM = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, amsgrad=True)
# On the wider GPU model eps=1e-6 makes Adam ill-conditioned: the update of a gradient near 0 turns float32
# reduction-order differences (4 ranks' sum against one batch) into 5e-5 after 20 steps, on the CPU too.
# eps=1e-3: 1.2e-7 there, while training on one rank's share still differs by 0.2.
WIDE_ADAM = {**ADAM, "eps": 1e-3}


def train(strategy, world, X, Y, make=Edgy, device="cpu", capturable=False, optimizer=None, adam=ADAM,
          **kw):
    """STEPS steps of Adam; strategy None: one process on the whole batch. Returns (parameters on the CPU,
    the closed DistributedOptimizer or None)."""
    torch.manual_seed(7)
    model = make().to(device)
    X, Y = X.to(device), Y.to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(trainable) if optimizer else torch.optim.Adam(trainable, capturable=capturable, **adam)
    dopt = wrap(opt, model, strategy, pto=True, **kw) if strategy else opt
    steps(world, dopt, model, X, Y, bool(strategy))
    return [p.detach().cpu().clone() for p in model.parameters()], (dopt if strategy else None)


@pytest.mark.parametrize("strategy", ["allreduce", "p3"])
def test_capturable_adam_wraps_and_steps_as_plain_adam(world, strategy):
    """The host-side shard optimizer runs without `capturable` (refused for host tensors, at wrap before)."""
    X, Y = data(world.Get_size())
    reference, _ = train(None, world, X, Y)  # capturable=True cannot step CPU parameters at all
    got, _ = train(strategy, world, X, Y, capturable=True)
    assert_everywhere(world, close(got, reference), f"{strategy} + pto with capturable Adam differs from Adam")


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv(STAGING_ENV, "force")


@pytest.mark.parametrize("strategy", ["p3", "wfbp"])
def test_staged_pto_reads_the_host_mirror_and_copies_no_gradient_back(world, forced, strategy):
    """Staged (a GPU's path, on the CPU): the update reads the averages in the host mirror, where the strategy
    left them, and writes the parameters; the gradients do not go back to the device (.grad keeps this
    rank's own, which is not what the update may use)."""
    X, Y = data(world.Get_size())
    reference, _ = train(None, world, X, Y)
    got, dopt = train(strategy, world, X, Y)
    staging = dopt.staging
    ok = close(got, reference) and staging is not None and staging.copies_to_device == 0
    assert_everywhere(world, ok and staging.copies_to_host > 0, f"{strategy}: {staging.copies_to_device} copies "
                                                                 "back to the device, or results differ")
    transfers = dopt.pto.transfers
    ok = transfers.device_waits == 0
    if strategy == "p3":  # the model's order in the buffers: the shard's gradient is one range, one copy a step
        ok = ok and transfers.ranges_copied == STEPS
    assert_everywhere(world, ok, f"{strategy}: {transfers.ranges_copied} gradient ranges, "
                                 f"{transfers.device_waits} waits")


def test_staged_pto_after_synchronize_updates_with_the_edited_gradients(world, forced):
    """synchronize() puts the averages in .grad for the user; the sharded update then reads .grad, edits and all."""
    X, Y = data(world.Get_size())
    torch.manual_seed(7)
    model = Edgy()
    trainable = [p for p in model.parameters() if p.requires_grad]
    r, ok = world.Get_rank(), True
    with wrap(torch.optim.SGD(trainable, lr=0.05), model, "wfbp", pto=True) as dopt:
        for step in range(3):
            x, y = X[step][r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH], Y[step][r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH]
            dopt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            dopt.synchronize()
            averaged = [p.grad.clone() for p in trainable]
            for p in trainable:
                p.grad.mul_(0.5)
            before = [p.detach().clone() for p in trainable]
            dopt.step()
            ok = ok and all(torch.allclose(p.detach(), b - 0.05 * 0.5 * g, atol=1e-7)
                            for p, b, g in zip(trainable, before, averaged))
        ok = ok and dopt.staging.copies_to_device > 0  # synchronize's
    assert_everywhere(world, ok, "the update did not use the gradients as edited after synchronize()")


# -- on a GPU -------------------------------------------------------------------------------------------------

class Wide(nn.Module):
    """4.3 M parameters (17 MB): the parameters' copy back takes milliseconds, not microseconds."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 2048)
        self.mid = nn.Linear(2048, 2048)
        self.out = nn.Linear(2048, 5)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "p3", "topk"])
def test_cuda_pto_with_capturable_adam_equals_one_process(world, device, strategy):
    """Adam(capturable=True) with non-default settings, 4 ranks on CUDA with PTO = one process's Adam on CUDA.

    Each step the GPU is kept busy (torch.cuda._sleep) after backward, so the parameters' copy back and the
    next step's gradients queue behind it while the host runs ahead."""
    X, Y = data(world.Get_size())
    X = torch.randn(X.shape[0], X.shape[1], 64, generator=torch.Generator().manual_seed(3))
    extra = {"sparse_options": {"density": 1.0}} if strategy == "topk" else {}

    class Busy(Wide):
        def forward(self, x):
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before every forward pass
            return super().forward(x)

    reference, _ = train(None, world, X, Y, make=Busy, device=device, capturable=True, adam=WIDE_ADAM)
    got, dopt = train(strategy, world, X, Y, make=Busy, device=device, capturable=True, adam=WIDE_ADAM, **extra)
    err = max((a - b).abs().max().item() for a, b in zip(got, reference))
    ok = close(got, reference, rtol=1e-4)
    if strategy != "topk":  # staged: the averages never went back to the device
        ok = ok and dopt.staging.copies_to_device == 0 and dopt.pto.transfers.device_waits == 0
    one_rank, _ = train(None, world, X[:, :LOCAL_BATCH], Y[:, :LOCAL_BATCH], make=Wide, device=device,
                        capturable=True, adam=WIDE_ADAM)
    assert_everywhere(world, ok, f"{strategy} + pto with capturable Adam on {device} differs from one process "
                                 f"(by up to {err:.3g}), or copied averages back "
                                 f"({dopt.staging.copies_to_device if dopt.staging else '-'} copies, "
                                 f"{dopt.pto.transfers.device_waits} waits)")
    assert_everywhere(world, not close(got, one_rank, rtol=1e-4), "test cannot fail")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_shard_is_not_rewritten_before_the_parameters_copy_read_it(world, device):
    """The parameters go back from pinned memory without the host waiting; the next step must not write the
    shard before that copy has read it. The copy is queued behind ~50 ms of GPU work and each step's
    parameters are snapshotted on the GPU behind it."""
    from runtime.pto import ShardedUpdate

    g = torch.Generator().manual_seed(0)
    host = [torch.randn(2048, 1024, generator=g), torch.randn(3000, generator=g)]
    params = [nn.Parameter(t.to(device)) for t in host]
    pto = ShardedUpdate(torch.optim.SGD(params, lr=1.0), params, world)
    start, stop = pto.shard
    total = sum(t.numel() for t in host)
    expected, snaps, flat = [], [], torch.cat([t.reshape(-1) for t in host])
    for step in range(3):
        grad = torch.randn(total, generator=torch.Generator().manual_seed(10 + step))
        flat = flat - grad
        expected.append(flat.clone())
        torch.cuda._sleep(100_000_000)
        pto.step(grad[start:stop].clone())
        snaps.append(torch.cat([p.detach().reshape(-1) for p in params]))  # queued behind the copy
    got = [s.cpu() for s in snaps]
    ok = all(torch.equal(a, b) for a, b in zip(got, expected))
    pto.close()
    worst = [float((a - b).abs().max()) for a, b in zip(got, expected)]
    assert_everywhere(world, ok, f"the parameters after each step differ by up to {worst}")
