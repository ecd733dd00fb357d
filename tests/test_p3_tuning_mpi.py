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


def test_online_credit_runs_the_same_trials_everywhere_keeps_one_credit_and_changes_no_result(world):
    """credit="online": every rank's exchange runs each step with the schedule's credit, the trials' figures are
    the same on every rank (the agreement's), every rank keeps the same credit, and training is unchanged."""
    model, reference = wide(), wide()
    dopt = DistributedOptimizer(sgd(model), model, P3Options(credit="online"))
    ref = DistributedOptimizer(sgd(reference), reference, "allreduce")
    trials = dopt.strategy.trials
    steps = len(trials.schedule) + 3
    g = torch.Generator().manual_seed(world.Get_rank())
    credits = []
    for _ in range(steps):
        x, y = torch.randn(8, 1024, generator=g), torch.randint(0, 4, (8,), generator=g)
        for m, o in ((model, dopt), (reference, ref)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
        credits.append(dopt.strategy.exchange.credit)  # the credit of the exchange step() has just begun
    dopt.synchronize()
    chosen, figures = trials.chosen, {c: list(v) for c, v in trials.figures.items()}
    same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(model.parameters(), reference.parameters()))
    dopt.close()
    ref.close()
    table = world.allgather((chosen, figures, credits))  # test-side check only
    expected = trials.schedule + [trials.start, chosen, chosen]
    ok = (len({repr(row) for row in table}) == 1 and chosen in trials.order and credits == expected
          and all(len(v) == 4 and min(v) > 0 for v in figures.values()) and same
          and dopt.strategy.tuning.online and f"chose {chosen}" in trials.describe())
    assert_everywhere(world, ok, f"chosen, figures, credits per rank: {table}; results equal {same}")
