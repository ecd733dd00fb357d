"""topk / hier-topk through DistributedOptimizer on a CUDA model: the CPU model's SGD, and host waits per step
that do not grow with the layers."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from runtime import DistributedOptimizer, TopkOptions

pytestmark = [pytest.mark.mpi, pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")]


class Stack(nn.Module):
    """`used` Linear layers in a chain and as many never called: gradients that only error feedback reaches."""

    def __init__(self, used: int, width: int = 64):
        super().__init__()
        self.used = nn.ModuleList(nn.Linear(width, width) for _ in range(used))
        self.unused = nn.ModuleList(nn.Linear(width, width) for _ in range(used))

    def forward(self, x):
        for layer in self.used:
            x = torch.tanh(layer(x))
        return x


def data(world, steps, width=64, batch=8):
    g = torch.Generator().manual_seed(100 + world.Get_rank())
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(steps)]


def run(world, device, options, used=4, steps=6, count_waits=False):
    """Train Stack(used) on `device`; (parameters on the CPU, host waits per step after the first two)."""
    torch.manual_seed(5)
    model = Stack(used).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    waits = []
    with DistributedOptimizer(opt, model, options, comm=world) as dopt:
        for step, (x, y) in enumerate(data(world, steps)):
            x, y = x.to(device), y.to(device)
            counting = count_waits and step >= 2  # buffers grown, plans made: a steady step
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                if counting:
                    torch.cuda.set_sync_debug_mode("warn")  # every host wait for the device warns
                try:
                    opt.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    dopt.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            if counting:
                waits.append(sum("synchronizing" in str(w.message) for w in seen))
    return [p.detach().cpu() for p in model.parameters()], waits


@pytest.mark.parametrize("strategy", ["topk", "hier-topk"])
@pytest.mark.parametrize("granularity", ["model", "layer"])
def test_full_density_on_cuda_is_the_cpu_models_sgd(world, device, strategy, granularity):
    """Density 1 sends everything: the CUDA model's parameters are the CPU model's (float32 tolerance)."""
    options = TopkOptions(density=1.0, hierarchical=strategy == "hier-topk", granularity=granularity)
    got, _ = run(world, device, options)
    want, _ = run(world, torch.device("cpu"), options)
    torch.manual_seed(5)
    moved = any(not torch.equal(a, b.detach()) for a, b in zip(want, Stack(4).parameters()))
    ok = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, want))
    assert_everywhere(world, ok and moved, f"{strategy} {granularity}: the CUDA model differs from the CPU model")


@pytest.mark.parametrize("strategy", ["topk", "hier-topk"])
def test_sparse_training_on_cuda_keeps_every_rank_identical(world, device, strategy):
    """Density 5% with DeviceMSTopK per layer: every rank holds the same parameters after every step."""
    got, _ = run(world, device, TopkOptions(density=0.05, hierarchical=strategy == "hier-topk",
                                            granularity="layer"))
    flat = torch.cat([p.flatten() for p in got]).double()
    everyone = world.allgather(flat.numpy().tobytes())
    assert_everywhere(world, all(b == everyone[0] for b in everyone) and bool(torch.isfinite(flat).all()),
                      f"{strategy}: ranks differ after sparse steps on CUDA")


@pytest.mark.parametrize("strategy", ["topk", "hier-topk"])
def test_host_waits_per_step_do_not_grow_with_the_layers(world, device, strategy):
    """granularity="layer" with unused layers: 4 and 16 layers make the host wait for the GPU equally often per
    step (one copy of the pairs per buffer, one finiteness read, one read of the unused layers), not once per
    layer (a blocking copy per layer, an .any() per unused parameter)."""
    options = TopkOptions(density=0.05, hierarchical=strategy == "hier-topk", granularity="layer")
    _, few = run(world, device, options, used=4, count_waits=True)
    _, many = run(world, device, options, used=16, count_waits=True)
    assert_everywhere(world, bool(few) and few == many,
                      f"{strategy}: host waits per step {few} with 4 layers, {many} with 16")
