"""Forward passes that branch on data: skipped modules, rank-dependent paths, parameters no rank used."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime import HybCommOptions, WfbpOptions

from conftest import assert_everywhere
from dp_helpers import Branchy, batches, close, max_diff, train

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

# Sequences of paths: 2 skips both experts, so in those steps `a` and `b` got no gradient anywhere.
SAME = [0, 1, 2, 0, 0, 2, 1, 1, 2, 2, 0, 1, 0, 2, 1, 0, 2, 1, 0, 0]

EXACT = ["allreduce", "wfbp", "p3", "allreduce+pto", "wfbp+pto", "p3+pto", "topk", "hier-topk"]


def options(name):
    """Keyword arguments for one strategy label; sparse ones at density 1, plain error feedback: exact."""
    base, _, pto = name.partition("+")
    kw = {"slice_size": 7} if base == "p3" else {}
    if base in ("topk", "hier-topk"):
        kw["sparse_options"] = {"density": 1.0, "momentum_correction": False}
    if pto:
        kw["pto"] = True
    return base, kw


@pytest.mark.parametrize("strategy", EXACT)
def test_same_branch_on_every_rank_equals_one_process(world, strategy):
    """A module skipped in a step is not updated (no gradient anywhere: weight decay and momentum leave it be)."""
    X, Y = batches(world.Get_size())
    path = lambda step, rank: SAME[step]  # noqa: E731
    want = train(world, None, Branchy, path, X, Y)
    base, kw = options(strategy)
    got = train(world, base, Branchy, path, X, Y, **kw)
    assert_everywhere(world, close(got, want), f"{strategy}: max difference {max_diff(got, want):.3g}")


@pytest.mark.parametrize("strategy", EXACT)
def test_rank_dependent_branches_equal_one_process(world, strategy):
    """Each rank takes its own path; averaged gradients count the ranks that did not use a module as zeros."""
    X, Y = batches(world.Get_size())
    path = lambda step, rank: (step * 7 + rank) % 3  # noqa: E731
    want = train(world, None, Branchy, path, X, Y)
    base, kw = options(strategy)
    got = train(world, base, Branchy, path, X, Y, **kw)
    assert_everywhere(world, close(got, want), f"{strategy}: max difference {max_diff(got, want):.3g}")
    # Every rank holds the same parameters (a rank-dependent update would make them drift apart).
    mine = torch.cat([p.reshape(-1) for p in got])
    first = mine.clone()
    world.Bcast(first.numpy(), root=0)
    assert_everywhere(world, torch.equal(mine, first), f"{strategy}: ranks' parameters differ")


@pytest.mark.parametrize("in_flight", [1, 2])
def test_wfbp_starts_its_buckets_in_one_order_on_every_rank_whatever_order_they_are_ready_in(world, in_flight):
    """A bucket per tensor, one or two allreduces under way: even ranks ready expert a's buckets in backward and
    b's only at step(), odd ranks the other way round. Started in the order they were ready, even ranks would hold
    a's ring and odd ranks b's, each waiting for the other (a hang, caught by the timeout); wfbp's window starts
    them in bucket order on every rank."""
    X, Y = batches(world.Get_size())
    path = lambda step, rank: rank % 2  # noqa: E731
    want = train(world, None, Branchy, path, X, Y)
    got = train(world, WfbpOptions(fuse_bytes=1, in_flight=in_flight), Branchy, path, X, Y)
    assert_everywhere(world, close(got, want), f"in_flight {in_flight}: max difference {max_diff(got, want):.3g}")


def test_first_steps_only_layer_is_left_alone_afterwards(world):
    """A layer used only in the first steps keeps the value those steps gave it, as with one process."""
    X, Y = batches(world.Get_size())
    path = lambda step, rank: 0 if step < 3 else 2  # noqa: E731
    want = train(world, None, Branchy, path, X, Y)
    for strategy in ("allreduce", "wfbp", "p3"):
        got = train(world, strategy, Branchy, path, X, Y, **options(strategy)[1])
        assert_everywhere(world, close(got, want), f"{strategy}: max difference {max_diff(got, want):.3g}")


class Wide(nn.Module):
    """x @ W, not an nn.Linear: hybcomm sends it through its dense strategy."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in ** 0.5)

    def forward(self, x):
        return x @ self.weight


class LateExpert(nn.Module):
    """A wide expert that runs last in the forward pass: p3 sends its slices last."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(11, 13)
        self.head = nn.Linear(13, 5)
        self.expert = Wide(13, 50_000)

    def forward(self, x, path=0):
        h = torch.tanh(self.inp(x))
        out = self.head(h)
        return out + self.expert(h)[:, :5] if path == 0 else out


@pytest.mark.parametrize("strategy", ["p3", "hybcomm"])
def test_a_module_no_rank_ran_waits_for_its_zero_average_before_its_next_gradient(world, strategy):
    """p3's exchange of a step runs on past step(): a module no rank ran sends its zero average last, and its
    gate in the next forward must wait for it, or the next gradient would accumulate first and be overwritten."""
    X, Y = batches(world.Get_size())
    path = lambda step, rank: step % 2  # noqa: E731
    want = train(world, None, LateExpert, path, X, Y)
    how = HybCommOptions(dense="p3", bandwidth=1e9, gflops=1e6) if strategy == "hybcomm" else strategy
    got = train(world, how, LateExpert, path, X, Y)
    assert_everywhere(world, close(got, want), f"{strategy}: max difference {max_diff(got, want):.3g}")
