"""Checkpoints hold the whole training state: a resumed run continues exactly, sparse strategies included."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from dp_helpers import batches, close, local, max_diff, wrap

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

SPARSE = {"density": 0.05, "warmup_steps": 2, "ramp_steps": 3}


def build():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(11, 13), nn.Tanh(), nn.Linear(13, 5))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def run(world, dopt, model, steps, X, Y):
    r = world.Get_rank()
    for step in steps:
        dopt.zero_grad()
        nn.functional.cross_entropy(model(local(X[step], r)), local(Y[step], r)).backward()
        dopt.step()


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("strategy", ["topk", "hier-topk"])
def test_sparse_resume_continues_exactly(world, strategy):
    """Step counter (dense warm-up, density ramp), error-feedback residuals and velocity survive a checkpoint."""
    X, Y = batches(world.Get_size(), steps=10)
    model, opt = build()
    dopt = wrap(opt, model, strategy, sparse_options=SPARSE)
    run(world, dopt, model, range(10), X, Y)
    dopt.close()
    straight = [p.detach().clone() for p in model.parameters()]

    model, opt = build()
    dopt = wrap(opt, model, strategy, sparse_options=SPARSE)
    run(world, dopt, model, range(4), X, Y)
    saved = roundtrip({"model": model.state_dict(), "optimizer": dopt.state_dict()})
    dopt.close()

    model, opt = build()
    model.load_state_dict(saved["model"])
    dopt = wrap(opt, model, strategy, sparse_options=SPARSE)
    dopt.load_state_dict(saved["optimizer"])
    run(world, dopt, model, range(4, 10), X, Y)
    dopt.close()
    resumed = [p.detach().clone() for p in model.parameters()]
    assert_everywhere(world, close(resumed, straight, rtol=1e-6, atol=1e-7),
                      f"{strategy}: resumed run differs by {max_diff(resumed, straight):.3g}")
