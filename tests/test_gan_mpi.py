"""A GAN's two optimizers on one graph (DCGAN's loop): the generator's backward runs through the discriminator."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_everywhere
from runtime import DistributedOptimizer

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

STEPS, BATCH = 4, 8  # per rank


def models():
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16)),
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))


def data(P: int):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(P * BATCH, 16, generator=gen), torch.randn(P * BATCH, 8, generator=gen)) for _ in range(STEPS)]


def train(G, D, og, od, batches, keep_local=contextlib.nullcontext):
    """DCGAN's loop: the discriminator's step on real and detached fakes, then the generator's through D (whose
    gradients of that pass nobody uses: od.zero_grad() drops them at the next step)."""
    for real, z in batches:
        fake = G(z)
        od.zero_grad()
        (F.softplus(-D(real)).mean() + F.softplus(D(fake.detach())).mean()).backward()
        od.step()
        og.zero_grad()
        with keep_local():
            F.softplus(-D(fake)).mean().backward()
        og.step()


def flat(*modules):
    return torch.cat([p.detach().reshape(-1) for m in modules for p in m.parameters()])


@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "p3", "hybcomm", "p3+pto"])
def test_the_generators_backward_under_the_discriminators_no_sync_trains_as_one_process(world, strategy):
    P, r = world.Get_size(), world.Get_rank()
    batches = data(P)
    G, D = models()
    og, od = torch.optim.SGD(G.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(D.parameters(), lr=0.1,
                                                                                     momentum=0.9)
    train(G, D, og, od, batches)
    want = flat(G, D)

    G, D = models()
    base, _, pto = strategy.partition("+")
    og = DistributedOptimizer(torch.optim.SGD(G.parameters(), lr=0.1, momentum=0.9), G, base, pto=bool(pto))
    od = DistributedOptimizer(torch.optim.SGD(D.parameters(), lr=0.1, momentum=0.9), D, base, pto=bool(pto))
    mine = [(real[r * BATCH:(r + 1) * BATCH], z[r * BATCH:(r + 1) * BATCH]) for real, z in batches]
    train(G, D, og, od, mine, keep_local=od.no_sync)
    og.close()
    od.close()
    got = flat(G, D)
    diff = (got - want).abs().max().item()
    assert_everywhere(world, diff < 1e-5, f"{strategy}: max difference {diff:.3g} from one process")


def test_without_no_sync_the_error_names_the_gan_and_the_fix(world):
    P, r = world.Get_size(), world.Get_rank()
    G, D = models()
    og = DistributedOptimizer(torch.optim.SGD(G.parameters(), lr=0.1), G, "wfbp")
    od = DistributedOptimizer(torch.optim.SGD(D.parameters(), lr=0.1), D, "wfbp")
    mine = [(real[r * BATCH:(r + 1) * BATCH], z[r * BATCH:(r + 1) * BATCH]) for real, z in data(P)]
    with pytest.raises(RuntimeError, match=r"became ready 2 times in one step.*GAN's generator step through its "
                                           r"discriminator\) belongs under this optimizer's no_sync\(\)"):
        train(G, D, og, od, mine)
    og.close()
    od.close()
