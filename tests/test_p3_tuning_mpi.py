"""The link probe and p3's automatic settings across 4 ranks: every rank measures, agrees and plans the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from dp_helpers import sgd
from mpicomm import link_probe
from mpicomm.link_probe import probe_link
from runtime import DistributedOptimizer, P3Options
from runtime.p3 import tuning

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def test_the_probe_gives_every_rank_the_same_finite_figures(world):
    est = probe_link(world, bytes_per_rank=1 << 18, rounds=2)
    table = world.allgather((est.bandwidth, est.round_time, est.step_time))  # test-side check only
    ok = len(set(table)) == 1 and 0 < est.bandwidth < float("inf") and est.round_time > 0 and est.step_time > 0
    assert_everywhere(world, ok, f"estimates per rank: {table}")


def wide():
    """2.1 M parameters: over the size below which p3 does not probe (4 slices of 256 KiB per rank)."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Linear(1024, 4))


def two_steps(world, strategy):
    model = wide()
    dopt = DistributedOptimizer(sgd(model), model, strategy)
    g = torch.Generator().manual_seed(world.Get_rank())
    for _ in range(2):
        dopt.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(8, 1024, generator=g)), torch.randint(0, 4, (8,), generator=g)) \
            .backward()
        dopt.step()
    tuned = getattr(dopt.strategy, "tuning", None)
    dopt.close()
    return [p.detach().clone() for p in model.parameters()], tuned


def test_auto_settings_are_measured_once_agreed_everywhere_and_change_no_result(world, monkeypatch):
    probes = []
    real = link_probe.probe_link
    monkeypatch.setattr(link_probe, "probe_link", lambda comm: probes.append(1) or real(comm))
    monkeypatch.setattr(link_probe, "_LINKS", {})
    auto, t = two_steps(world, P3Options())
    _, again = two_steps(world, P3Options())
    reference, _ = two_steps(world, "allreduce")
    plans = world.allgather(t.describe())
    ok = (len(probes) == 1 and t.link is not None and again == t and len(set(plans)) == 1
          and t.chosen == ("slice_size", "credit")
          and all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(auto, reference)))
    assert_everywhere(world, ok, f"probes {len(probes)}, plans {plans}, again {again}")


def test_a_small_model_is_not_probed(world, monkeypatch):
    """Below 4 smallest slices per rank the link cannot change the plan: no collective, no start-up cost."""
    monkeypatch.setattr(link_probe, "probe_link", lambda comm: pytest.fail("probed a small model"))
    model = nn.Linear(64, 8)
    with DistributedOptimizer(sgd(model), model, P3Options()) as dopt:
        t = dopt.strategy.tuning
    assert_everywhere(world, t.link is None and t.slice_size * 4 == tuning.MIN_SLICE_BYTES, t.describe())
