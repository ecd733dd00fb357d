"""Every strategy is exact synchronous SGD: same parameters as one process on the whole batch, and as DDP."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from dp_helpers import ddp_parameters, wrap
from runtime import STRATEGIES, AllreduceOptions, DistributedOptimizer, WfbpOptions

pytestmark = pytest.mark.mpi

STEPS, LOCAL_BATCH = 20, 6


class Edgy(nn.Module):
    """Layers smaller than a slice, slices crossing layers, a 1-element tensor, frozen, tied and unused weights."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(11, 13)
        self.frozen = nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(13, 13)
        self.head = nn.Linear(13, 5, bias=False)
        self.tied = nn.Linear(13, 5, bias=False)
        self.tied.weight = self.head.weight  # one Parameter, two modules
        self.scale = nn.Parameter(torch.tensor([0.7]))
        self.unused = nn.Linear(3, 3)  # never called: its gradient is zeros

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        h = torch.tanh(self.frozen(h)) + h
        h = torch.relu(self.mid(h))
        return (self.head(h) + 0.5 * self.tied(h)) * self.scale


class Attention(nn.Module):
    """nn.MultiheadAttention reads out_proj.weight without running out_proj's forward: gated by its parent."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(11, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 5)

    def forward(self, x):
        h = self.inp(x).unsqueeze(1).expand(-1, 3, -1)
        h, _ = self.attn(h, h, h)
        return self.out(h.mean(1))


def data(world_size):
    g = torch.Generator().manual_seed(1234)
    n = LOCAL_BATCH * world_size
    return torch.randn(STEPS, n, 11, generator=g), torch.randint(0, 5, (STEPS, n), generator=g)


def train(strategy, world, X, Y, slice_size=7, make=Edgy, adam=False, device="cpu", **kw):
    """Train 20 SGD+momentum (or Adam) steps; strategy None is the single-process reference on the full batch.

    device: where the model and batches are (the parameters come back on the CPU).
    """
    torch.manual_seed(7)
    model = make().to(device)
    X, Y = X.to(device), Y.to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trainable, lr=0.01) if adam else torch.optim.SGD(trainable, lr=0.05, momentum=0.9)
    dopt = wrap(opt, model, strategy, slice_size=slice_size if strategy == "p3" else None, **kw) if strategy else opt
    steps(world, dopt, model, X, Y, strategy is not None)
    return [p.detach().cpu().clone() for p in model.parameters()]


def steps(world, dopt, model, X, Y, shared: bool) -> None:
    """STEPS steps of cross-entropy; shared: each rank on its LOCAL_BATCH of the batch, then closed (else one
    process on the whole batch)."""
    r = world.Get_rank()
    for step in range(STEPS):
        x, y = X[step], Y[step]
        if shared:
            x, y = x[r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH], y[r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH]
        dopt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        dopt.step()
    if shared:
        dopt.close()


def close(a, b, rtol=1e-5):
    return all(torch.allclose(x, y, rtol=rtol, atol=1e-6) for x, y in zip(a, b))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_equals_single_process_on_whole_batch(world, strategy):
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y)
    got = train(strategy, world, X, Y)
    assert_everywhere(world, close(got, reference), f"{strategy} differs from one process on the whole batch")
    assert_everywhere(world, not close(got, train(None, world, X[:, :1], Y[:, :1])), "test cannot fail")


@pytest.mark.parametrize("adam", [False, True], ids=["sgd", "adam"])
@pytest.mark.parametrize("strategy", [*STRATEGIES, "topk"])
def test_pto_equals_single_process(world, strategy, adam):
    """PTO (sharded update + allgather) composes with every exact strategy, and with topk at density 1."""
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y, adam=adam)
    extra = {"sparse_options": {"density": 1.0}} if strategy == "topk" else {}
    got = train(strategy, world, X, Y, adam=adam, pto=True, **extra)
    assert_everywhere(world, close(got, reference), f"{strategy} + pto differs from one process")


@pytest.mark.parametrize("slice_size", [1, 5, 13, 1000])
def test_p3_slice_sizes(world, slice_size):
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y)
    assert_everywhere(world, close(train("p3", world, X, Y, slice_size), reference), f"slice {slice_size}")


@pytest.mark.parametrize("fuse_bytes", [1, 200, 1 << 20])
def test_wfbp_buckets(world, fuse_bytes):
    """Every tensor alone, small buckets mixing tensors, everything in one bucket."""
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y)
    assert_everywhere(world, close(train("wfbp", world, X, Y, fuse_bytes=fuse_bytes), reference), f"{fuse_bytes}")


@pytest.mark.parametrize("opts", [
    AllreduceOptions(algorithm="hierarchical", node_window=True),
    WfbpOptions(fuse_bytes=200, algorithm="hierarchical", in_flight=None, node_window=True),
], ids=["allreduce", "wfbp-all-in-flight"])
def test_the_hierarchys_node_window_equals_single_process(world, opts):
    """Through the node's shared window (mpicomm.node_stage) wherever MPI's single copy: on two levels (2 hosts or
    emulated nodes of 2) the window, elsewhere the flat path; either way one process's parameters."""
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y)
    assert_everywhere(world, close(train(opts, world, X, Y), reference), opts.describe())


def test_p3_waits_for_weights_read_by_a_parent_module(world):
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y, make=Attention)
    assert_everywhere(world, close(train("p3", world, X, Y, 5, make=Attention), reference), "attention")


def test_equals_torch_ddp_over_gloo(world):
    X, Y = data(world.Get_size())
    ddp_params = ddp_parameters(world, Edgy, X, Y, LOCAL_BATCH)
    for strategy in STRATEGIES:
        assert_everywhere(world, close(train(strategy, world, X, Y), ddp_params), f"{strategy} vs DDP")


def test_models_that_differ_are_named(world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4 + (world.Get_rank() == 1)), nn.Linear(4 + (world.Get_rank() == 1), 2))
    from mpicomm import CollectiveMismatchError

    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    with pytest.raises(CollectiveMismatchError, match=r"rank 1: parameter 0.weight \(5, 4\)"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, "p3")


@pytest.mark.timeout(60)  # the old code hung on a frozen layer of another dtype
@pytest.mark.parametrize("differs", ["shape", "dtype"])
def test_frozen_parameters_that_differ_are_named_on_every_rank(world, differs):
    """A frozen layer is broadcast from rank 0 like the rest: one that differs is named, not a raw MPI error or a hang."""
    from mpicomm import CollectiveMismatchError

    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    r = world.Get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if differs == "shape":
        model.emb = nn.Embedding(10 + (r == 1), 8)
    else:
        model.emb = nn.Linear(4, 4)
        if r == 1:
            model.emb.double()
    model.emb.requires_grad_(False)
    try:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, "allreduce").close()
        message = None
    except Exception as exc:  # noqa: BLE001 - judged by its type and message below
        message = f"{type(exc).__name__}: {exc}"
    want = {"shape": ("(10, 8) torch.float32 frozen", "(11, 8) torch.float32 frozen"),
            "dtype": ("(4, 4) torch.float32 frozen", "(4, 4) torch.float64 frozen")}[differs]
    others = ", ".join(str(q) for q in range(world.Get_size()) if q != 1)
    ok = message is not None and message.startswith("CollectiveMismatchError") \
        and f"rank {others}: parameter emb.weight {want[0]}" in message \
        and f"rank 1: parameter emb.weight {want[1]}" in message
    assert_everywhere(world, ok, f"got {message!r}")


def test_initial_parameters_come_from_rank_0(world):
    torch.manual_seed(world.Get_rank())  # every rank starts different
    model = nn.Linear(5, 3)
    with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, "wfbp"):
        w = model.weight.detach().clone()
    torch.manual_seed(0)
    assert_everywhere(world, torch.equal(w, nn.Linear(5, 3).weight.detach()), "not rank 0's weights")


def test_pto_with_frozen_parameters_in_the_optimizer(world):
    """An optimizer built from model.parameters() (frozen ones included) works with pto, as without it."""
    X, Y = data(world.Get_size())
    results = []
    for pto in (False, True):
        torch.manual_seed(7)
        model = Edgy()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        with wrap(opt, model, "allreduce", pto=pto) as dopt:
            r = world.Get_rank()
            for step in range(3):
                dopt.zero_grad()
                x, y = X[step][r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH], Y[step][r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH]
                nn.functional.cross_entropy(model(x), y).backward()
                dopt.step()
            state = dopt.state_dict()
            kept = len(opt.state) == 0 if pto else True  # after a checkpoint the shards stay the only copy
        results.append(([p.detach().clone() for p in model.parameters()], len(state["optimizer"]["state"]), kept))
    ok = close(results[0][0], results[1][0]) and results[0][1] == results[1][1] and results[1][2]
    assert_everywhere(world, ok, "pto with frozen parameters differs from the unsharded step")


ZEROINGS = ["optimizer", "optimizer, in place", "model", "model, in place", "assigned"]


def zeroing_loop(world, X, Y, strategy, zeroing, device="cpu"):
    """STEPS steps of Edgy on `device` under `strategy`, each zeroing its gradients not through the wrapper but as
    `zeroing` says (one of ZEROINGS); returns the parameters (on the CPU) and whether, after close(), the
    optimizer's zero_grad is torch's own again."""
    torch.manual_seed(7)
    model = Edgy().to(device)
    X, Y = X.to(device), Y.to(device)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    r = world.Get_rank()
    with wrap(opt, model, strategy, slice_size=7 if strategy == "p3" else None) as dopt:
        for step in range(STEPS):
            x, y = X[step][r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH], Y[step][r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH]
            if zeroing.startswith("model"):
                # set_to_none: .grad dropped; in place: p3's averages in flight are not where .grad points
                model.zero_grad(set_to_none=zeroing == "model")
            elif zeroing == "assigned":  # tensors of the loop's own in .grad, copied into the buffers
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
            else:
                opt.zero_grad(set_to_none=zeroing == "optimizer")
            nn.functional.cross_entropy(model(x), y).backward()
            dopt.step()
    return [p.detach().cpu().clone() for p in model.parameters()], "zero_grad" not in vars(opt)


@pytest.mark.parametrize("strategy", ["p3", "wfbp"])
@pytest.mark.parametrize("zeroing", ZEROINGS)
def test_a_loop_zeroing_through_the_wrapped_optimizer_or_the_model_equals_one_process(world, strategy, zeroing):
    """zero_grad() called on the optimizer the user made or on the model (in place too), or zeros assigned to
    .grad, not through the wrapper (common loops): p3's deferred updates still read their averages; after close()
    that optimizer's zero_grad is torch's own again."""
    X, Y = data(world.Get_size())
    reference = train(None, world, X, Y)
    got, unrouted = zeroing_loop(world, X, Y, strategy, zeroing)
    assert_everywhere(world, close(got, reference), f"{strategy}: the loop zeroing through the {zeroing} "
                                                    "differs from one process")
    assert_everywhere(world, unrouted, "the optimizer's zero_grad is still routed after close")
