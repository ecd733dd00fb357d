"""Gradients of mixed dtypes and memory layouts: exact per dtype, no silent down-cast, channels_last accepted."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from dp_helpers import batches, close, max_diff, train

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

STRATEGIES = ["allreduce", "wfbp", "p3", "topk"]


def options(strategy):
    if strategy == "p3":
        return {"slice_size": 7}
    if strategy == "topk":
        return {"sparse_options": {"density": 1.0, "momentum_correction": False}}
    return {}


class Mixed(nn.Module):
    """A float64 network beside a float32 one, trained together (two dtype buffers, one step).

    Their losses add, so float64 gradients owe nothing to float32 arithmetic:
    any rounding through float32 in the exchange shows up, far above the
    float64 summation noise.
    """

    def __init__(self):
        super().__init__()
        self.aux = nn.Linear(11, 5)  # first: a buffer sized by the first parameter's dtype would be float32
        self.body = nn.Linear(11, 13, dtype=torch.float64)
        self.head = nn.Linear(13, 5, dtype=torch.float64)

    def forward(self, x, path=0):
        return self.head(torch.tanh(self.body(x.double()))), self.aux(x)


class ConvNet(nn.Module):
    """Convolutions whose weights (and so gradients) are channels_last."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.conv2 = nn.Conv2d(6, 4, 3)
        self.fc = nn.Linear(4, 5)
        self.to(memory_format=torch.channels_last)

    def forward(self, x, path=0):
        x = x.reshape(-1, 3, 5, 5).contiguous(memory_format=torch.channels_last)
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(h.flatten(1))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float64_layer_is_averaged_in_float64(world, strategy):
    X, Y = batches(world.Get_size())
    want = train(world, None, Mixed, lambda s, r: 0, X, Y)
    got = train(world, strategy, Mixed, lambda s, r: 0, X, Y, **options(strategy))
    # Rounding the float64 gradients through float32 shows up around 1e-8; summation order near 1e-15.
    f64 = [(a, b) for a, b in zip(got, want) if a.dtype == torch.float64]
    ok64 = len(f64) == 4 and all(torch.allclose(a, b, rtol=1e-11, atol=1e-13) for a, b in f64)
    assert_everywhere(world, close(got, want) and ok64, f"{strategy}: max difference "
                      f"{max(float((a - b).abs().max()) for a, b in f64):.3g} in float64")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_channels_last_gradients(world, strategy):
    X, Y = batches(world.Get_size(), features=75)
    want = train(world, None, ConvNet, lambda s, r: 0, X, Y)
    got = train(world, strategy, ConvNet, lambda s, r: 0, X, Y, **options(strategy))
    assert_everywhere(world, close(got, want), f"{strategy}: max difference {max_diff(got, want):.3g}")
