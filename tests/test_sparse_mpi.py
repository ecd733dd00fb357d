"""Top-k sparse allreduce (flat and hierarchical), error feedback, and the topk / hier-topk strategies."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from mpi4py import MPI

from conftest import assert_everywhere
from mpicomm import CollectiveMismatchError, Topology
from mpicomm.buffers import block_counts, offsets
from mpicomm.sparse_allreduce import SparseAllreduce
from dp_helpers import wrap
from runtime.sparse.error_feedback import ErrorFeedback
from runtime.sparse import NonFiniteGradientError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]


def layouts(world_size):
    """ranks_per_node values that divide the world: 1 node, 1 rank per node, and in between."""
    return sorted({1, world_size} | {r for r in (2, 3) if world_size % r == 0})


def topk_select(density):
    def select(x):
        k = min(x.numel(), max(1, math.ceil(density * x.numel())))
        _, idx = torch.topk(x.abs(), k)
        return x[idx], idx
    return select


def dense_sum(world, x):
    out = np.empty_like(x.numpy())
    world.Allreduce(x.numpy(), out)
    return torch.from_numpy(out)


def sparse_ints(rank, n=1000, nnz=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.zeros(n, dtype=dtype)
    x[torch.randperm(n, generator=g)[:nnz]] = torch.randint(1, 50, (nnz,), generator=g).to(dtype)
    return x


@pytest.mark.parametrize("hierarchical", [False, True])
def test_density_one_equals_dense_allreduce(world, hierarchical):
    P = world.Get_size()
    for rpn in layouts(P):
        with Topology(world, ranks_per_node=rpn) as topo:
            op = SparseAllreduce(topo, hierarchical=hierarchical)
            g = torch.Generator().manual_seed(world.Get_rank())
            x = torch.randint(-20, 20, (1001,), generator=g).float()
            got = op(x, topk_select(1.0))
            op.free()
            assert_everywhere(world, torch.equal(got, dense_sum(world, x)), f"rpn={rpn}")


@pytest.mark.parametrize("hierarchical", [False, True])
def test_applied_is_every_ranks_positions_in_a_buffer_kept_across_calls(world, hierarchical):
    """`applied` (the positions momentum masking forgets) as int64, every position a pair was added at; a second
    call of the same size writes the same buffer (no allocation a step)."""
    P = world.Get_size()
    with Topology(world, ranks_per_node=2 if P % 2 == 0 else 1) as topo:
        op = SparseAllreduce(topo, hierarchical=hierarchical)
        ok, ptrs = True, []
        for step in range(2):
            x = sparse_ints(world.Get_rank() + 10 * step)
            got = op(x, topk_select(0.005)).clone()
            ok = ok and op.applied.dtype == torch.int64 and op.applied.numel() == op.pairs > 0
            got[op.applied] = 0  # the result is nonzero only where some rank's pair was added
            ok = ok and not got.any()
            ptrs.append(op.applied.data_ptr())
        op.free()
        assert_everywhere(world, ok and ptrs[0] == ptrs[1], f"applied {op.applied[:8]}, buffers {ptrs}")


@pytest.mark.parametrize("hierarchical", [False, True])
def test_add_sums_into_what_out_holds(world, hierarchical):
    """add=True (an emulated device zeroes the result in modelled time): the sum lands on out's values."""
    P = world.Get_size()
    with Topology(world, ranks_per_node=2 if P % 2 == 0 else 1) as topo:
        op = SparseAllreduce(topo, hierarchical=hierarchical)
        x = torch.randint(-20, 20, (1001,), generator=torch.Generator().manual_seed(world.Get_rank())).float()
        out = torch.full_like(x, 3.0)
        got = op(x.clone(), topk_select(1.0), out=out, add=True)
        op.free()
        assert_everywhere(world, got is out and torch.equal(out, dense_sum(world, x) + 3.0), "the sum plus 3")


@pytest.mark.parametrize("hierarchical", [False, True])
def test_gather_only_exchanges_every_ranks_pairs_and_writes_nothing(world, hierarchical):
    """gather_only=True (an emulated device sums in modelled time): the pairs cross, `pairs` counts them, out is
    untouched; the next ordinary call sums again."""
    P = world.Get_size()
    with Topology(world, ranks_per_node=2 if P % 2 == 0 else 1) as topo:
        op = SparseAllreduce(topo, hierarchical=hierarchical)
        x = torch.randint(-20, 20, (1001,), generator=torch.Generator().manual_seed(world.Get_rank())).float()
        out = torch.full_like(x, 3.0)
        sent = op.traffic.intra + op.traffic.inter
        got = op(x.clone(), topk_select(0.1), out=out, gather_only=True)
        gathered = op.pairs
        moved = op.traffic.intra + op.traffic.inter - sent
        again = op(x.clone(), topk_select(1.0))
        op.free()
        # Flat: P blocks of k = 101 pairs; hierarchical: each node shard's k, from every node.
        expected = P * 101 if not hierarchical else topo.num_nodes * sum(
            max(1, -(-c // 10)) for c in block_counts(1001, topo.local_size))
        assert_everywhere(world, got is out and torch.equal(out, torch.full_like(x, 3.0)), "out was written")
        assert_everywhere(world, gathered == expected and moved > 0, f"pairs {gathered} (expected {expected}), "
                          f"{moved} bytes sent")
        assert_everywhere(world, torch.equal(again, dense_sum(world, x)), "the next call's sum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hierarchical_equals_flat_when_selection_covers_nonzeros(world, dtype):
    """k >= nonzeros per rank and per node shard: nothing is dropped, both give the exact sum."""
    P = world.Get_size()
    x = sparse_ints(world.Get_rank(), dtype=dtype)
    want = dense_sum(world, x)
    topos = [Topology(world, ranks_per_node=rpn) for rpn in layouts(P)] + [Topology(world)]
    for topo in topos:
        flat, hier = SparseAllreduce(topo, hierarchical=False), SparseAllreduce(topo, hierarchical=True)
        a, b = flat(x, topk_select(0.1)), hier(x, topk_select(0.1))
        flat.free(), hier.free()
        ok = torch.equal(a, want) and torch.equal(b, want)
        assert_everywhere(world, ok, f"{topo!r}")
        topo.free()


@pytest.mark.parametrize("hierarchical", [False, True])
def test_error_feedback_invariant(world, hierarchical):
    """Everything applied so far plus every rank's residual equals the sum of every gradient given."""
    P, r = world.Get_size(), world.Get_rank()
    n = 997
    rpn = 2 if P % 2 == 0 else 1
    with Topology(world, ranks_per_node=rpn) as topo:
        op = SparseAllreduce(topo, hierarchical=hierarchical)
        ef = ErrorFeedback(lambda x, k: (x[torch.topk(x.abs(), k).indices], torch.topk(x.abs(), k).indices))
        g = torch.Generator().manual_seed(r)
        applied = torch.zeros(n, dtype=torch.float64)
        given = torch.zeros(n, dtype=torch.float64)
        for _ in range(6):
            x = torch.randn(n, generator=g, dtype=torch.float64)
            given += x
            applied += op(x, lambda v: ef.select("m", v, 0.03))
        op.free()
        residual = torch.zeros(n, dtype=torch.float64)
        if hierarchical:
            counts = block_counts(n, topo.local_size)
            lo = offsets(counts)[topo.local_rank]
            residual[lo:lo + counts[topo.local_rank]] = ef.residual("m")
        else:
            residual = ef.residual("m")
        total = applied + dense_sum(world, residual)
        ok = torch.allclose(total, dense_sum(world, given), rtol=0, atol=1e-9)
        sent_something = bool((ef.residual("m") != 0).any())
    assert_everywhere(world, ok and sent_something, "applied + residual != accumulated gradients")


def test_hierarchical_sends_fewer_inter_node_bytes(world):
    P = world.Get_size()
    if P % 2 or P < 4:
        pytest.skip("needs at least 2 nodes x 2 ranks")
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(world.Get_rank()))
    inter = {}
    with Topology(world, ranks_per_node=2) as topo:
        for hier in (False, True):
            op = SparseAllreduce(topo, hierarchical=hier)
            op(x, topk_select(0.01))
            inter[hier] = world.allreduce(op.traffic.inter)
            op.free()
    assert_everywhere(world, 0 < inter[True] <= inter[False] / 2, f"inter-node bytes {inter}")


# -- the strategies, through DistributedOptimizer -----------------------------------------------------
class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.scale = nn.Linear(9, 17), nn.Linear(17, 4), nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def train(world, strategy, steps=5, poison=None, **sparse):
    torch.manual_seed(3)
    model = Small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(50 + world.Get_rank())
    with wrap(opt, model, strategy, sparse_options=sparse) as dopt:
        for step in range(steps):
            dopt.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(8, 9, generator=g)), torch.randint(0, 4, (8,), generator=g)
                                        ).backward()
            if poison is not None and step == poison[0] and world.Get_rank() == poison[1]:
                model.fc2.weight.grad[0, 0] = float("nan")
            dopt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("strategy", ["topk", "hier-topk"])
@pytest.mark.parametrize("options", [dict(density=1.0, operator="exact"), dict(density=1.0),
                                     dict(density=1.0, granularity="layer"),
                                     dict(density=0.01, warmup_steps=5)])
def test_full_density_or_warmup_equals_allreduce(world, strategy, options):
    want = train(world, "allreduce")
    got = train(world, strategy, **options)
    ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want))
    assert_everywhere(world, ok, f"{strategy} {options} differs from allreduce")


@pytest.mark.parametrize("strategy", ["topk", "hier-topk"])
def test_sparse_training_moves_and_stays_identical_across_ranks(world, strategy):
    params = train(world, strategy, steps=8, density=0.1)
    flat = torch.cat([p.reshape(-1) for p in params])
    everyone = world.allgather(flat.numpy().tobytes())
    start = torch.cat([p.detach().reshape(-1) for p in (torch.manual_seed(3), Small())[1].parameters()])
    ok = all(e == everyone[0] for e in everyone) and not torch.equal(flat, start)
    assert_everywhere(world, ok, "ranks diverged or nothing was learnt")


@pytest.mark.parametrize("strategy", ["topk", "hier-topk"])
def test_nan_gradient_is_named_on_every_rank(world, strategy):
    bad = world.Get_size() - 1
    with pytest.raises(NonFiniteGradientError, match=rf"rank {bad}: non-finite gradient .* in fc2\.weight"):
        train(world, strategy, steps=3, poison=(1, bad), density=0.1)


def test_densities_must_match_across_ranks(world):
    if world.Get_size() == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(CollectiveMismatchError, match=r"rank 0: strategy topk density=0\.2"):
        train(world, "topk", steps=1, density=0.1 if world.Get_rank() else 0.2)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_bad_density(world, bad):
    with pytest.raises(ValueError, match="density must be in"):
        train(world, "topk", steps=1, density=bad)


def test_checkpoints_keep_the_momentum_the_user_set(world):
    """Momentum correction moves the SGD's momentum into the sparsifier; a checkpoint still says 0.9."""
    torch.manual_seed(3)
    model = Small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with wrap(opt, model, "topk", sparse_options={"density": 0.1}) as dopt:
        state = dopt.state_dict()
        dopt.load_state_dict(state)
        ok = state["optimizer"]["param_groups"][0]["momentum"] == 0.9 and opt.param_groups[0]["momentum"] == 0.0
        ok = ok and dopt.strategy.momentum == 0.9
    assert_everywhere(world, ok, "momentum lost in the checkpoint round trip")


def test_mpi_world_is_untouched(world):
    """Strategies work on duplicates: nothing is left pending on the caller's communicator."""
    train(world, "hier-topk", steps=2, density=0.1)
    assert not world.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
