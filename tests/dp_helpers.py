"""Shared pieces of the data-parallel tests: a model with data-dependent branches and exact references."""

from __future__ import annotations

import torch
import torch.nn as nn

from runtime import DistributedOptimizer, P3Options, TopkOptions, WfbpOptions

STEPS, LOCAL_BATCH = 20, 6


class Branchy(nn.Module):
    """Path 0 runs `a`, path 1 runs `b`, path 2 skips both: mixture-of-experts / early-exit in miniature."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.inp = nn.Linear(11, 13, dtype=dtype)
        self.a = nn.Linear(13, 13, dtype=dtype)
        self.b = nn.Linear(13, 13, dtype=dtype)
        self.head = nn.Linear(13, 5, dtype=dtype)

    def forward(self, x, path=0):
        h = torch.tanh(self.inp(x))
        if path == 0:
            h = h + torch.tanh(self.a(h))
        elif path == 1:
            h = h + torch.tanh(self.b(h))
        return self.head(h)


def batches(world_size, steps=STEPS, features=11, seed=1234):
    g = torch.Generator().manual_seed(seed)
    n = LOCAL_BATCH * world_size
    return torch.randn(steps, n, features, generator=g), torch.randint(0, 5, (steps, n), generator=g)


def local(t, rank):
    return t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]


def options(strategy, slice_size=None, credit=None, fuse_bytes=None, sparse_options=None):
    """A strategy name and the old-style keyword settings as an options object."""
    if strategy == "p3" and (slice_size or credit):
        return P3Options(**{k: v for k, v in dict(slice_size=slice_size, credit=credit).items() if v})
    if strategy == "wfbp" and fuse_bytes:
        return WfbpOptions(fuse_bytes=fuse_bytes)
    if strategy in ("topk", "hier-topk"):
        return TopkOptions(hierarchical=strategy == "hier-topk", **(sparse_options or {}))
    return strategy


def wrap(optimizer, model, strategy, slice_size=None, credit=None, fuse_bytes=None, sparse_options=None, **kw):
    """The distributed optimizer under test (one place to follow API changes)."""
    return DistributedOptimizer(optimizer, model, options(strategy, slice_size, credit, fuse_bytes, sparse_options),
                                **kw)


def sgd(model, **kw):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                           **{"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2, **kw})


def cross_entropy(out, y):
    """The loss of every model here; a tuple of outputs (independent heads) adds their losses."""
    if isinstance(out, tuple):
        return sum(nn.functional.cross_entropy(o, y) for o in out)
    return nn.functional.cross_entropy(out, y)


def train(world, strategy, make, path_of, X, Y, optimizer=sgd, steps=STEPS, **kw):
    """Train `steps` steps on this rank's share; strategy None: one process on every rank's share at once.

    path_of(step, rank) picks the model's branch; the single-process reference
    averages the per-rank losses, each with that rank's branch, which is what
    data-parallel SGD computes.
    """
    torch.manual_seed(7)
    model = make()
    opt = optimizer(model)
    r, P = world.Get_rank(), world.Get_size()
    dopt = wrap(opt, model, strategy, **kw) if strategy else opt
    for step in range(steps):
        dopt.zero_grad()
        if strategy:
            loss = cross_entropy(model(local(X[step], r), path_of(step, r)), local(Y[step], r))
        else:
            loss = sum(cross_entropy(model(local(X[step], q), path_of(step, q)), local(Y[step], q))
                       for q in range(P)) / P
        loss.backward()
        dopt.step()
    if strategy:
        dopt.close()
    return [p.detach().clone() for p in model.parameters()]


def ddp_parameters(world, make, X, Y, local_batch, loss=nn.functional.cross_entropy, steps=STEPS):
    """torch DDP over gloo on the same ranks: momentum SGD (lr 0.05, 0.9) on each rank's share of X, Y."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mpicomm.torchdist import init_gloo, shutdown_gloo

    from mpicomm.agree import fail_together

    r = world.Get_rank()
    # A gloo collective that never completes (seen once on the fake hosts: rank 0 inside DDP's backward while
    # the others had moved on) raises gloo's timeout on that rank well inside the test's own limit; every rank
    # then fails together, naming it, instead of the others waiting in their next collective.
    init_gloo(world, timeout_s=30)
    problem, params = None, None
    try:
        params = _train_ddp(DDP, r, make, X, Y, local_batch, loss, steps)
    except RuntimeError as exc:  # gloo's timeout, or its error when a peer's socket closed
        problem = f"torch DDP over gloo: {exc}"
    try:
        fail_together(world, problem, RuntimeError)
    finally:
        shutdown_gloo(world)  # the DDP model is gone by now, as shutdown_gloo asks
    return params


def _train_ddp(DDP, r, make, X, Y, local_batch, loss, steps):
    """ddp_parameters' training, in a function of its own so that the DDP model dies on its return."""
    torch.manual_seed(7)
    model = make()
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    for step in range(steps):
        sl = slice(r * local_batch, (r + 1) * local_batch)
        opt.zero_grad()
        loss(ddp(X[step][sl]), Y[step][sl]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def close(a, b, rtol=1e-5, atol=1e-6):
    return all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b))


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))
