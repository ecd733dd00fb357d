"""Module buffers (BatchNorm running statistics) stay the same on every rank, so evaluation agrees."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from mpi4py import MPI

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


def test_p3_carries_the_buffers_in_its_exchange_and_averages_them_as_the_allreduce_does(world):
    """p3 takes the buffers' vector into its own exchange (a slice more, the most urgent): no MPI allreduce of
    them, one vector handed over a step, and after each step every rank holds the mean over ranks of what each
    rank's BatchNorm held at step(), as the per-buffer average computes it."""
    from runtime import DistributedOptimizer

    r, P = world.Get_rank(), world.Get_size()
    model = bn_model()
    bn = model[1]
    dopt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, "p3")
    g = torch.Generator().manual_seed(5)
    ok, worst = True, 0.0
    for step in range(3):
        xs = [torch.randn(8, 6, generator=g) + 2 * q for q in range(P)]  # rank q's data is shifted by 2q
        y = torch.randint(0, 3, (8,), generator=g)
        dopt.zero_grad()
        nn.functional.cross_entropy(model(xs[r]), y).backward()
        held = [per_buffer_average(world, b) for b in (bn.running_mean, bn.running_var)]  # what step() packs
        dopt.step()
        dopt.synchronize()  # writes the average back, as the next forward would
        for b, want in zip((bn.running_mean, bn.running_var), held):
            worst = max(worst, float((b - want).abs().max()))
            ok = ok and torch.allclose(b, want, rtol=1e-6, atol=1e-7)
    sync = dopt.model_buffers
    carried = sync.carrier is dopt.strategy if P > 1 else sync.carrier is None
    rounds = (sync.carried_rounds, sync.collectives) == ((3, 0) if P > 1 else (0, 0))
    dopt.close()
    assert_everywhere(world, ok and carried and rounds,
                      f"worst difference {worst:g}; carried by p3: {carried}; "
                      f"{sync.carried_rounds} vectors handed over, {sync.collectives} allreduces")


@pytest.mark.parametrize("yield_link", [True, False])
def test_p3_holds_its_sends_from_each_step_until_the_buffers_average_is_in(world, yield_link):
    """P3Options.yield_link: with buffers averaged by MPI's allreduce (a watched one keeps p3 from carrying them),
    p3 sends nothing new from step() until the step's agreement and the buffers' average are done (released by
    the next forward, or synchronize()): one hold a step on the timeline, none with yield_link=False; released at
    the end either way. Buffers p3 carries need no hold."""
    from runtime import DistributedOptimizer, P3Options
    from runtime.trace import Timeline

    tl = Timeline(world.Get_rank())
    model = bn_model()
    model.register_buffer("positions", torch.linspace(-1, 1, 4), persistent=False)  # watched: not carried
    dopt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model,
                                P3Options(yield_link=yield_link), timeline=tl)
    g = torch.Generator().manual_seed(5)
    held = []
    for _ in range(3):
        dopt.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(8, 6, generator=g)), torch.randint(0, 3, (8,), generator=g)
                                    ).backward()
        dopt.step()
        held.append(dopt.strategy.exchange.holding)
    dopt.synchronize()
    released = not dopt.strategy.exchange.holding
    dopt.close()
    holds = [e for e in tl.to_trace()["traceEvents"] if e["ph"] == "X" and e["name"].startswith("hold")]
    expect = 3 if yield_link and world.Get_size() > 1 else 0
    ok = len(holds) == expect and held == [expect > 0] * 3 and released
    assert_everywhere(world, ok, f"yield_link={yield_link}: {len(holds)} holds for 3 steps, held {held}, "
                                 f"released at the end: {released}")
    carried = bn_model()
    dopt = DistributedOptimizer(torch.optim.SGD(carried.parameters(), lr=0.05), carried, P3Options(yield_link=True))
    dopt.zero_grad()
    nn.functional.cross_entropy(carried(torch.randn(8, 6, generator=g)), torch.randint(0, 3, (8,), generator=g)
                                ).backward()
    dopt.step()
    never = not dopt.strategy.exchange.holding
    dopt.close()
    assert_everywhere(world, never, "p3 held its sends for buffers it carries")


class Stats(nn.Module):
    """Buffers of several shapes and dtypes, a constant one (persistent=False) and a cache it may rebuild."""

    def __init__(self):
        super().__init__()
        self.bn1 = nn.BatchNorm1d(5)
        self.bn2 = nn.BatchNorm2d(3, dtype=torch.float64)
        self.register_buffer("ema", torch.zeros(2, 4, dtype=torch.float16))
        self.register_buffer("empty", torch.zeros(0))
        self.register_buffer("positions", torch.linspace(-1, 1, 6).view(2, 3), persistent=False)
        self.register_buffer("cache", torch.ones(4), persistent=False)


def per_buffer_average(world, b: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of one buffer as the per-buffer code computed it: float64 sum, times 1/P, cast back."""
    total = b.detach().cpu().double().numpy().copy()
    world.Allreduce(MPI.IN_PLACE, total)
    return torch.from_numpy(total * (1.0 / world.Get_size())).to(b.dtype).view(b.shape)


def rank_values(model, r: int, step: int) -> None:
    """Each rank's own running statistics, as its BatchNorm would leave them."""
    g = torch.Generator().manual_seed(100 * step + r)
    with torch.no_grad():
        for name in ("bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var", "ema"):
            b = model.get_buffer(name)
            b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float64).to(b.dtype))


def test_one_packed_allreduce_equals_the_per_buffer_average_and_constants_stay(world):
    """All floating buffers travel in one vector, one MPI call a step, bitwise as averaged one by one; the
    persistent=False ones are not sent while unchanged (float64 averaging would not even keep them exact)."""
    from mpicomm.stall import StallPolicy
    from runtime.model_buffers import BufferSync

    r = world.Get_rank()
    model = Stats()
    comm = world.Dup()
    sync = BufferSync(model, comm, "average", StallPolicy())
    positions = model.positions.clone()
    sent = [model.bn1.running_mean, model.bn1.running_var, model.bn2.running_mean, model.bn2.running_var, model.ema]
    ok, why = True, ""
    for step in range(3):
        rank_values(model, r, step)
        want = [per_buffer_average(world, b) for b in sent]
        sync.start()
        sync.finish()
        for b, w in zip(sent, want):
            if not torch.equal(b, w):
                ok, why = False, f"step {step}: {tuple(b.shape)} {b.dtype} differs by {float((b - w).abs().max())}"
    ok = ok and torch.equal(model.positions, positions)
    ok = ok and sync.staging.size == sum(b.numel() for b in sent) + 2  # the values, and a flag per watched buffer
    assert_everywhere(world, ok, f"{why}; staging of {sync.staging.size} elements")
    ok = sync.collectives == 3 and [id(b) for b in sync.watched] == [id(model.positions), id(model.cache)]
    assert_everywhere(world, ok, f"{sync.collectives} collectives")
    sync.free()
    comm.Free()


def test_a_watched_buffer_changed_on_one_rank_is_averaged_at_once_and_sent_from_then_on(world):
    from mpicomm.stall import StallPolicy
    from runtime.model_buffers import BufferSync

    r, P = world.Get_rank(), world.Get_size()
    model = Stats()
    comm = world.Dup()
    sync = BufferSync(model, comm, "average", StallPolicy())
    ok = True
    for step in range(4):
        rank_values(model, r, step)
        if step == 1 and r == P - 1:
            with torch.no_grad():
                model.cache.fill_(1.0 + P)  # a rebuilt cache: this rank only
        if step == 2:
            with torch.no_grad():
                model.cache.add_(r)  # sent now: averaged with the others
        want = per_buffer_average(world, model.cache)
        sync.start()
        sync.finish()
        ok = ok and torch.equal(model.cache, want)
    # Step 1: (1 + P + (P - 1) * 1) / P = 2 everywhere, then step 2 adds the mean of the ranks.
    ok = ok and torch.equal(model.cache, torch.full((4,), 2.0 + (P - 1) / 2))
    ok = ok and [id(b) for b in sync.watched] == [id(model.positions)] and sync.collectives == 4 + 1
    assert_everywhere(world, ok, f"cache {model.cache.tolist()}, {sync.collectives} collectives")
    sync.free()
    comm.Free()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
def test_cuda_buffers_travel_in_one_copy_each_way_behind_the_work_that_wrote_them(world):
    """On a GPU: one packed copy to pinned memory and one back per step, bitwise the per-buffer average. The
    buffers' new values are written behind ~50 ms of GPU work (as a forward pass leaves them queued): the pack
    must be ordered after them, and the average written back before the next reads."""
    from jobs.common.devices import rank_device
    from mpicomm import Topology
    from mpicomm.stall import StallPolicy
    from runtime.model_buffers import BufferSync

    with Topology(world) as topo:
        device = rank_device("cuda", topo)
    r = world.Get_rank()
    host, model = Stats(), Stats().to(device)
    comm = world.Dup()
    sync = BufferSync(model, comm, "average", StallPolicy())
    names = ["bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var", "ema"]
    positions, ok, why = model.positions.clone(), True, ""
    for step in range(3):
        rank_values(host, r, step)
        want = [per_buffer_average(world, host.get_buffer(n)) for n in names]
        pinned = [host.get_buffer(n).pin_memory() for n in names]
        torch.cuda._sleep(100_000_000)
        with torch.no_grad():
            for n, v in zip(names, pinned):
                model.get_buffer(n).copy_(v, non_blocking=True)
        sync.start()
        sync.finish()
        for n, w in zip(names, want):
            if not torch.equal(model.get_buffer(n).cpu(), w):
                ok, why = False, f"step {step}: {n} differs by {float((model.get_buffer(n).cpu() - w).abs().max())}"
    ok = ok and (sync.copies_to_host, sync.copies_to_device, sync.collectives) == (3, 3, 3)
    ok = ok and torch.equal(model.positions, positions) and len(sync.watched) == 2
    assert_everywhere(world, ok, f"{why}; copies {sync.copies_to_host} out, {sync.copies_to_device} back, "
                                 f"{sync.collectives} collectives")
    sync.free()
    comm.Free()


def test_which_buffers_travel(world):
    """BatchNorm's statistics are sent, its counter is not; the Transformer's positions are watched only; with
    "broadcast" every floating buffer is sent (the rule runtime.sim mirrors)."""
    from runtime.model_buffers import synced_buffers
    from runtime.workloads.models import TransformerNMT

    nmt = TransformerNMT(vocab=16, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                         dim_feedforward=16, max_len=12)
    model = bn_model()
    bn = model[1]
    ok = synced_buffers(nmt) == ([], [nmt.positions]) and synced_buffers(nmt, "broadcast") == ([nmt.positions], [])
    sent, watched = synced_buffers(model)
    ok = ok and [id(b) for b in sent] == [id(bn.running_mean), id(bn.running_var)] and watched == []
    ok = ok and synced_buffers(model, "none") == ([], [])
    assert_everywhere(world, ok, "synced_buffers")
