"""hybcomm is exact synchronous SGD whatever the plan: sufficient factors, ring allreduce, or a mix; and its bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from dp_helpers import ddp_parameters
from runtime import CollectiveMismatchError, DistributedOptimizer, HybCommOptions, PeerFailedError

pytestmark = pytest.mark.mpi

STEPS, LOCAL_BATCH, T = 20, 6, 4


class Mixed(nn.Module):
    """A conv, Linear layers the cost model sends by factors (wide, few rows) and by PS (a narrow head),
    a Linear fed [B, T, M] rows, a frozen one, a tied one, one run twice and one never run."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3, padding=1)
        self.wide = nn.Linear(88, 64)
        self.seq = nn.Linear(16, 128)  # 3-D inputs: K = batch x T rows
        self.seq2 = nn.Linear(128, 128)
        self.frozen = nn.Linear(64, 64)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64 + 128, 5)
        self.tied = nn.Linear(64, 64, bias=False)
        self.tied.weight = self.mid.weight  # shared: its gradient is not one layer's factors
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.tanh(self.conv(x[:, :44].view(-1, 2, 22))).flatten(1)
        h = torch.tanh(self.wide(h))
        h = torch.tanh(self.frozen(h)) + h
        h = torch.relu(self.mid(h)) + 0.5 * torch.tanh(self.tied(h))
        s = torch.tanh(self.seq2(torch.tanh(self.seq(x[:, 44:].view(-1, T, 16))))).mean(1)
        return self.head(torch.cat([h, s], 1))


class Twice(nn.Module):
    """One wide Linear applied twice in a forward pass."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(108, 64)
        self.block = nn.Linear(64, 64)
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.block(h))
        return self.head(torch.tanh(self.block(h)))


class ConvOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 5, 3)

    def forward(self, x):
        return self.conv(x[:, None, :]).mean(2)


def data(world_size, steps=STEPS):
    g = torch.Generator().manual_seed(1234)
    n = LOCAL_BATCH * world_size
    return torch.randn(steps, n, 44 + T * 16, generator=g), torch.randint(0, 5, (steps, n), generator=g)


def train(options, world, X, Y, make=Mixed, pto=False, sizes=None):
    """20 momentum-SGD steps with hybcomm; sizes[r]: rank r's samples. Returns (parameters, the last plan)."""
    torch.manual_seed(7)
    model = make()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    r, P = world.Get_rank(), world.Get_size()
    sizes = sizes or [LOCAL_BATCH] * P
    lo, hi = sum(sizes[:r]), sum(sizes[:r + 1])
    dopt = DistributedOptimizer(opt, model, options, comm=world, pto=pto)
    for step in range(X.shape[0]):
        dopt.zero_grad()
        # A local sum over LOCAL_BATCH: P ranks' average is then the reference's loss, and an empty
        # rank's loss is well defined (zero).
        (nn.functional.cross_entropy(model(X[step][lo:hi]), Y[step][lo:hi], reduction="sum") / LOCAL_BATCH).backward()
        dopt.step()
    plan = dopt.strategy.plan
    dopt.close()
    return [p.detach().clone() for p in model.parameters()], plan


def mixed_and_sgd(make=Mixed):
    """The model under test (seeded) and momentum SGD over its trainable parameters."""
    torch.manual_seed(7)
    model = make()
    return model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)


def reference(world, X, Y, make=Mixed, sizes=None):
    """One process on the whole batch, with the loss scaled as P ranks averaging their local sums."""
    P = world.Get_size()
    torch.manual_seed(7)
    model = make()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    n = sum(sizes) if sizes else LOCAL_BATCH * P
    for step in range(X.shape[0]):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X[step][:n]), Y[step][:n], reduction="sum")
        (loss / (LOCAL_BATCH * P)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def close(a, b, rtol=1e-5):
    return all(torch.allclose(x, y, rtol=rtol, atol=1e-6) for x, y in zip(a, b))


FAST_LINK = dict(bandwidth=1e9, gflops=1e6)  # a slow link, free arithmetic: bytes decide


@pytest.mark.parametrize("force, dense", [("auto", "wfbp"), ("sfb", "wfbp"), ("ps", "wfbp"), ("auto", "p3"),
                                          ("sfb", "p3")])
def test_equals_one_process_for_every_plan(world, force, dense):
    X, Y = data(world.Get_size())
    got, plan = train(HybCommOptions(force=force, dense=dense, slice_size=50, **FAST_LINK), world, X, Y)
    assert_everywhere(world, close(got, reference(world, X, Y)), f"hybcomm force={force} dense={dense}")
    choices = {c.name: c.choice for c in plan}
    assert set(choices) == {"wide", "seq", "seq2", "head", "unused"}  # conv, frozen, tied: the dense path
    if force == "auto":
        assert [choices[n] for n in ("wide", "seq", "seq2", "head")] == ["sfb", "ps", "sfb", "ps"], choices
        assert {c.name: c.K for c in plan} == {"wide": 6, "seq": 24, "seq2": 24, "head": 6, "unused": 0}
    else:
        assert set(choices.values()) == {force}


def test_equals_torch_ddp(world):
    X, Y = data(world.Get_size())
    ddp_params = ddp_parameters(world, Mixed, X, Y, LOCAL_BATCH,
                                lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum") / LOCAL_BATCH)
    for force in ("auto", "sfb"):
        got, _ = train(HybCommOptions(force=force, **FAST_LINK), world, X, Y)
        assert_everywhere(world, close(got, ddp_params), f"hybcomm force={force} vs DDP")


def test_with_pto(world):
    X, Y = data(world.Get_size())
    got, plan = train(HybCommOptions(**FAST_LINK), world, X, Y, pto=True)
    assert_everywhere(world, close(got, reference(world, X, Y)), "hybcomm + pto")
    assert {c.choice for c in plan} == {"sfb", "ps"}


def test_sfb_layers_send_factors_only_and_keep_no_rows(world):
    """Forced SFB on an all-Linear model: no gradient message at all, and no captured rows after the step."""
    X, Y = data(world.Get_size(), steps=2)
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(108, 32), nn.Tanh(), nn.Linear(32, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    r = world.Get_rank()
    with DistributedOptimizer(opt, model, HybCommOptions(force="sfb"), comm=world) as dopt:
        for step in range(2):
            opt.zero_grad()
            sl = slice(r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH)
            nn.functional.cross_entropy(model(X[step][sl]), Y[step][sl]).backward()
            dopt.step()
            assert all(not ex.pairs for ex in dopt.strategy.exchanges)
        traffic = dict(dopt.strategy.traffic)
        assert dopt.strategy.inner is None
    assert traffic == {"sfb": 2 * LOCAL_BATCH * ((108 + 32) + (32 + 5)), "ps": 0}, traffic


def test_layer_used_twice_goes_ps_and_stays_exact(world, capfd):
    g = torch.Generator().manual_seed(5)
    P = world.Get_size()
    X, Y = torch.randn(STEPS, LOCAL_BATCH * P, 108, generator=g), torch.randint(0, 5, (STEPS, LOCAL_BATCH * P), generator=g)
    got, plan = train(HybCommOptions(force="sfb"), world, X, Y, make=Twice)
    assert_everywhere(world, close(got, reference(world, X, Y, make=Twice)), "layer used twice")
    why = {c.name: (c.choice, c.reason) for c in plan}
    assert why["block"] == ("ps", "used twice in one forward pass"), why
    assert why["inp"][0] == "sfb" and why["head"][0] == "sfb"
    err = capfd.readouterr().err
    if world.Get_rank() == 0:
        assert err.count("block goes through a ring allreduce") == 1, err


def test_an_empty_rank_and_changing_batch_sizes(world):
    """Rank 1 has no sample at all (a sum-reduced loss is well defined), then every rank's batch changes."""
    P = world.Get_size()
    X, Y = data(P)
    sizes = [LOCAL_BATCH] * P
    sizes[1] = 0
    got, plan = train(HybCommOptions(**FAST_LINK), world, X, Y, sizes=sizes)
    assert_everywhere(world, close(got, reference(world, X, Y, sizes=sizes)), "a rank with batch 0")
    assert {c.name: c.K for c in plan}["wide"] == LOCAL_BATCH

    model, opt = mixed_and_sgd()
    versions, ks, plans = [], [], []
    with DistributedOptimizer(opt, model, HybCommOptions(**FAST_LINK), comm=world) as dopt:
        for batch in (6, 6, 2, 2, 6):
            opt.zero_grad()
            nn.functional.cross_entropy(model(X[0][:batch]), Y[0][:batch]).backward()
            dopt.step()
            versions.append(dopt.strategy.plan_version)
            plans.append(dopt.strategy.plan)
            ks.append({c.name: c.K for c in plans[-1]}["wide"])
    assert versions == [1, 1, 2, 2, 3] and ks == [6, 6, 2, 2, 6], (versions, ks)
    assert plans[4] is plans[0]  # a batch size seen before: its plan is not computed again


def test_gradient_accumulation_concatenates_factors(world):
    """Two backward passes per step (half the local batch each): the factors of both are summed."""
    X, Y = data(world.Get_size())
    model, opt = mixed_and_sgd()
    r, half = world.Get_rank(), LOCAL_BATCH // 2
    with DistributedOptimizer(opt, model, HybCommOptions(force="sfb"), comm=world,
                              backward_passes_per_step=2) as dopt:
        for step in range(STEPS):
            dopt.zero_grad()
            for part in range(2):
                sl = slice(r * LOCAL_BATCH + part * half, r * LOCAL_BATCH + (part + 1) * half)
                (nn.functional.cross_entropy(model(X[step][sl]), Y[step][sl], reduction="sum")
                 / LOCAL_BATCH).backward()
            dopt.step()
        assert {c.name: c.K for c in dopt.strategy.plan}["wide"] == LOCAL_BATCH
    got = [p.detach().clone() for p in model.parameters()]
    assert_everywhere(world, close(got, reference(world, X, Y)), "two backward passes per step")


def test_model_without_linear_layers_is_the_dense_strategy(world, capfd):
    g = torch.Generator().manual_seed(3)
    P = world.Get_size()
    X, Y = torch.randn(STEPS, LOCAL_BATCH * P, 9, generator=g), torch.randint(0, 5, (STEPS, LOCAL_BATCH * P), generator=g)
    got, plan = train(HybCommOptions(), world, X, Y, make=ConvOnly)
    assert_everywhere(world, close(got, reference(world, X, Y, make=ConvOnly)), "conv only")
    assert plan is None
    if world.Get_rank() == 0:
        assert "no Linear layer can send sufficient factors: hybcomm is wfbp for this model" in capfd.readouterr().err


def test_ranks_with_other_link_bandwidths_are_named(world, monkeypatch):
    monkeypatch.setenv("MPITRAIN_LINK_BANDWIDTH", "1gbit" if world.Get_rank() == 1 else "10gbit")
    model = Mixed()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    # Its dense path's allreduce (auto, told the link) or its own cost model: whichever asks first names them.
    with pytest.raises(CollectiveMismatchError, match=r"rank 1: (hybcomm link bandwidth 1e\+09|"
                                                      r"\$MPITRAIN_LINK_BANDWIDTH='1gbit')"):
        DistributedOptimizer(opt, model, HybCommOptions(gflops=1.0), comm=world)


def test_ranks_planning_from_other_inputs_stop_together(world):
    """A rank whose cost-model inputs changed after wrapping: every rank raises before any layer is sent."""
    X, Y = data(world.Get_size(), steps=2)
    model, opt = mixed_and_sgd()
    r = world.Get_rank()
    dopt = DistributedOptimizer(opt, model, HybCommOptions(**FAST_LINK), comm=world)
    if r == 2:
        import dataclasses
        dopt.strategy.links = dataclasses.replace(dopt.strategy.links, gflops=1.0)
    sl = slice(r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH)
    dopt.zero_grad()
    # Each rank finds the mismatch itself, or first hears of it from a rank that did: either way it is named.
    with pytest.raises((CollectiveMismatchError, PeerFailedError), match="ranks would plan from different inputs.*rank 2"):
        nn.functional.cross_entropy(model(X[0][sl]), Y[0][sl]).backward()
        dopt.step()
    dopt.close()


def test_a_rank_without_backward_in_a_step_does_not_hang(world):
    """Rank 1 skips forward and backward in step 1 (its census comes only from step()): every rank goes on."""
    X, Y = data(world.Get_size(), steps=3)
    model, opt = mixed_and_sgd()
    r = world.Get_rank()
    sl = slice(r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH)
    with DistributedOptimizer(opt, model, HybCommOptions(force="sfb"), comm=world) as dopt:
        for step in range(3):
            dopt.zero_grad()
            if not (step == 1 and r == 1):
                nn.functional.cross_entropy(model(X[step][sl]), Y[step][sl]).backward()
            dopt.step()
        assert {c.name: c.K for c in dopt.strategy.plan}["wide"] == LOCAL_BATCH
    params = [p.detach().clone() for p in model.parameters()]
    assert_everywhere(world, close(params, _from(world, params)), "ranks drifted apart")


def _from(world, params, root=0):
    """Rank `root`'s copy of these tensors."""
    return [torch.from_numpy(world.bcast(p.numpy(), root=root)) for p in params]
