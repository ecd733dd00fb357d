"""Module buffers (BatchNorm running statistics) stay the same on every rank, so evaluation agrees."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from dp_helpers import wrap

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "p3", "topk"])
def test_running_statistics_agree_across_ranks(world, strategy):
    """Each rank sees data with its own mean; the running statistics are averaged over ranks every step."""
    r, P = world.Get_rank(), world.Get_size()
    model = bn_model()
    dopt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model, strategy)
    g = torch.Generator().manual_seed(5)
    shards = []
    for step in range(6):
        xs = [torch.randn(8, 6, generator=g) + q for q in range(P)]  # rank q's data is shifted by q
        y = torch.randint(0, 3, (8,), generator=g)
        shards.append(xs)
        dopt.zero_grad()
        nn.functional.cross_entropy(model(xs[r]), y).backward()
        dopt.step()
    dopt.synchronize()
    bn = model[1]
    stats = torch.cat([bn.running_mean, bn.running_var])
    first = stats.clone()
    world.Bcast(first.numpy(), root=0)
    assert_everywhere(world, torch.allclose(stats, first, rtol=1e-6, atol=1e-7), "running statistics differ by rank")
    model.eval()
    out = model(torch.ones(2, 6)).detach()
    ref = out.clone()
    world.Bcast(ref.numpy(), root=0)
    assert_everywhere(world, torch.allclose(out, ref, rtol=1e-6, atol=1e-7), "evaluation differs by rank")
    dopt.close()


@pytest.mark.parametrize("mode", ["average", "broadcast", "none"])
def test_buffer_sync_modes(world, mode):
    from runtime.model_buffers import BufferSync
    from mpicomm.stall import StallPolicy

    r, P = world.Get_rank(), world.Get_size()
    model = bn_model()
    bn = model[1]
    comm = world.Dup()
    sync = BufferSync(model, comm, mode, StallPolicy())
    with torch.no_grad():
        bn.running_mean.fill_(float(r))
        bn.num_batches_tracked.fill_(7 + r)
    sync.start()
    sync.finish()
    want = {"average": (P - 1) / 2, "broadcast": 0.0, "none": float(r)}[mode]
    ok = torch.allclose(bn.running_mean, torch.full((8,), want)) and int(bn.num_batches_tracked) == 7 + r
    assert_everywhere(world, ok, f"{mode}: got {bn.running_mean.tolist()}")
    sync.free()
    comm.Free()


def test_a_timeline_shows_each_steps_agreement_and_the_wait_for_the_buffers(world):
    """Both are waits of the training thread that can sit behind bulk traffic (8 ranks, p3: 0.3-1 s each on a
    1 Gbit/s emulated cluster): a timeline must show them, one per step."""
    from runtime import DistributedOptimizer
    from runtime.trace import Timeline

    tl = Timeline(world.Get_rank())
    model = bn_model()
    dopt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, "p3", timeline=tl)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        dopt.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(8, 6, generator=g)), torch.randint(0, 3, (8,), generator=g)
                                    ).backward()
        dopt.step()
    dopt.synchronize()
    dopt.close()
    names = [e["name"] for e in tl.to_trace()["traceEvents"] if e["ph"] == "X" and e.get("cat") == "sync"]
    agreements, buffers = names.count("wait step agreement"), names.count("wait module buffers")
    ok = agreements == 3 and (buffers == 3 or world.Get_size() == 1)
    assert_everywhere(world, ok, f"{agreements} step agreements and {buffers} buffer waits for 3 steps")
