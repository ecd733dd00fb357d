"""DistributedOptimizer: wrap any torch optimizer so gradients are averaged over MPI ranks with a chosen strategy."""

from __future__ import annotations

import contextlib

import torch

from mpicomm import Topology
from mpicomm.agree import broadcast_tensors, check_same_structure

from .forward_gate import ForwardGate
from .sparse_strategies import SPARSE_STRATEGIES
from .strategies import DEFAULT_FUSE_BYTES, DEFAULT_SLICE_SIZE, STRATEGIES, P3Sync

ALL_STRATEGIES = {**STRATEGIES, **SPARSE_STRATEGIES}


class DistributedOptimizer:
    """Synchronous data-parallel SGD over MPI; the training loop stays as it was.

        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, strategy="p3")
        for x, y in batches:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        opt.synchronize()   # before evaluating or saving outside a forward pass

    At wrap time the model's structure is checked across ranks and rank 0's
    parameters, buffers and optimizer state are broadcast. Gradients are
    averaged exactly (every strategy is full-gradient synchronous SGD):
    - allreduce: one fused ring allreduce after backward;
    - wfbp: each gradient's allreduce starts as soon as backward produces it
      (gradients under `fuse_bytes` share buckets);
    - p3: gradients cut into `slice_size`-element slices exchanged through a
      sharded parameter server by forward-pass priority; `step()` returns at
      once and each layer's update is applied just before that layer's next
      forward, so early layers compute while later ones still synchronise.
    - topk / hier-topk (not exact: sparsified with error feedback): only the
      largest `density` fraction of the gradient is exchanged, flat over all
      ranks or hierarchically (dense inside a node, sparse across nodes);
      `sparse_options` go to runtime.sparse_strategies.TopkSync (density,
      error_feedback, warmup_steps, ramp_steps, granularity, operator,
      momentum_correction, momentum_masking). With momentum_correction
      (default) an SGD's momentum moves into the sparsifier, DGC-style: the
      wrapped SGD's groups are set to momentum 0, each rank's velocity is
      what gets sparsified, and (momentum_masking) cleared where applied.
    pto=True (any strategy): each rank applies the optimizer to its 1/P of
    the parameters, with 1/P of the optimizer state, then the parameters are
    allgathered (runtime.pto); with allreduce, the gradients are only
    reduce-scattered. Updates then happen at step(), also under p3.
    Frozen parameters are skipped; parameters that got no gradient count as
    zeros; tied weights are synchronised once. p3 needs an optimizer whose
    update of one parameter depends only on that parameter (SGD, Adam, ...).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, strategy: str = "p3",
                 topology: Topology | None = None, slice_size: int = DEFAULT_SLICE_SIZE, credit: int = 8,
                 fuse_bytes: int = DEFAULT_FUSE_BYTES, timeline=None, sparse_options: dict | None = None,
                 pto: bool = False):
        if strategy not in ALL_STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r} (choose from {', '.join(ALL_STRATEGIES)})")
        if sparse_options and strategy not in SPARSE_STRATEGIES:
            raise ValueError(f"sparse_options apply to {', '.join(SPARSE_STRATEGIES)}, not {strategy!r}")
        self.optimizer, self.model, self.timeline = optimizer, model, timeline
        self._own_topology = topology is None
        self.topology = topology or Topology()
        self.comm = self.topology.world
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._check_and_broadcast()
        kwargs = {"p3": dict(slice_size=slice_size, credit=credit), "wfbp": dict(fuse_bytes=fuse_bytes)}.get(strategy, {})
        self.pto = None
        if pto:  # first: a refusal (mixed dtypes, a parameter it cannot place) leaves nothing half-built
            from .pto import ShardedUpdate

            self.pto = ShardedUpdate(optimizer, self.params, self.comm)
            self.pto.load_from(optimizer)
            optimizer.state.clear()  # the shards hold the state now: 1/P of it per rank
        if strategy in SPARSE_STRATEGIES:
            names = {id(p): n for n, p in model.named_parameters()}
            kwargs = dict(sparse_options or {}, topology=self.topology, names=[names[id(p)] for p in self.params])
            if kwargs.pop("momentum_correction", True):
                kwargs["momentum"] = _take_sgd_momentum(optimizer)
        if pto and strategy == "allreduce":
            kwargs["reduce_scatter_only"] = True
        self.strategy = ALL_STRATEGIES[strategy](self.comm, self.params, timeline, **kwargs)
        self._ready = [False] * len(self.params)
        self._pending: dict[int, list] = {}  # param index -> hyper-parameters of the step() that owes it
        self._zero_requested: bool | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.gate = ForwardGate(model, self.params, self._on_module_enter)

    # -- set-up --------------------------------------------------------------
    def _check_and_broadcast(self) -> None:
        named = list(self.model.named_parameters())
        entries = [f"{n} {tuple(p.shape)} {p.dtype} grad={p.requires_grad}" for n, p in named]
        entries += [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in self.model.named_buffers()]
        check_same_structure(self.comm, entries)
        with torch.no_grad():
            broadcast_tensors(self.comm, [p.detach() for _, p in named] + list(self.model.buffers()))
        state = self.optimizer.state_dict()["state"]
        tensors = [v for k in sorted(state) for _, v in sorted(state[k].items()) if torch.is_tensor(v) and v.dim()]
        check_same_structure(self.comm, [f"{tuple(t.shape)} {t.dtype}" for t in tensors], "optimizer state tensor")
        broadcast_tensors(self.comm, tensors)

    # -- hooks ---------------------------------------------------------------
    def _freeze_gate(self) -> None:
        if self.gate.gate is None:
            # The first forward pass is over: gates and priorities are known from now on.
            priority = self.gate.freeze()
            if isinstance(self.strategy, P3Sync):
                self.strategy.set_priorities(priority)

    def _on_grad(self, p: torch.Tensor) -> None:
        self._freeze_gate()
        i = self.strategy.index[id(p)]
        if self._ready[i]:
            raise RuntimeError("a parameter's gradient became ready twice in one step: call step() "
                               "after every backward (gradient accumulation is not supported yet)")
        self._ready[i] = True
        self.strategy.grad_ready(i, p.grad)

    def _on_module_enter(self, params: list[int]) -> None:
        owed = [i for i in params if i in self._pending]
        if owed:
            self._apply(owed)

    # -- the optimizer interface -----------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._pending:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        # Parameters still owed an update keep their (averaged) gradient until it is applied.
        self._zero_requested = set_to_none
        for i, p in enumerate(self.params):
            if i not in self._pending and p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure")
        self._freeze_gate()
        missing = [i for i, r in enumerate(self._ready) if not r]
        for i in missing:
            # Every rank must send every tensor; a parameter unused this step contributes zeros.
            p = self.params[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._ready[i] = True
            self.strategy.grad_ready(i, p.grad)
        self.strategy.finish()
        self._ready = [False] * len(self.params)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        if self.strategy.layerwise and self.pto is None:
            for i in range(len(self.params)):
                self._pending[i] = hyper
            return None
        for i in range(len(self.params)):
            self.strategy.wait(i)
        if self.pto is not None:
            self.pto.step(getattr(self.strategy, "grad_shard", None))
        else:
            self.optimizer.step()
        return None

    def synchronize(self) -> None:
        """Finish all communication and apply every update still owed (before eval, checkpoints)."""
        if self._pending:
            self._apply(sorted(self._pending))

    def _apply(self, owed: list[int]) -> None:
        """Run the wrapped optimizer's step on just these parameters, with the hyper-parameters of their step()."""
        tl = self.timeline
        for i in owed:
            if tl:
                with tl.span(f"wait p{i}", "sync", param=i):
                    self.strategy.wait(i)
            else:
                self.strategy.wait(i)
        owed_set = set(owed)
        by_hyper: dict[int, tuple] = {}
        for i in owed:
            by_hyper.setdefault(id(self._pending[i]), (self._pending[i], []))[1].append(i)
        hidden = [(p, p.grad) for j, p in enumerate(self.params) if j not in owed_set and p.grad is not None]
        with _grads_hidden(hidden):
            for hyper, idxs in by_hyper.values():
                keep = set(idxs)
                others = [(self.params[j], self.params[j].grad) for j in owed if j not in keep]
                with _grads_hidden(others), _hyperparameters(self.optimizer, hyper):
                    self.optimizer.step()
        for i in owed:
            del self._pending[i]
            if self._zero_requested is not None:
                p = self.params[i]
                p.grad = None if self._zero_requested else p.grad.zero_()
        if not self._pending:
            self._zero_requested = None

    # -- checkpoints ---------------------------------------------------------
    def state_dict(self):
        """The wrapped optimizer's state dict (collective under pto: the shards are gathered into it)."""
        self.synchronize()
        if self.pto is not None:
            self.pto.consolidate_into(self.optimizer)
        state = self.optimizer.state_dict()
        if self.pto is not None:
            self.optimizer.state.clear()  # the dict keeps its tensors; the shards stay the only live copy
        moved = getattr(self.strategy, "momentum", 0.0)
        for group in state["param_groups"] if moved else ():
            group["momentum"] = moved  # what the user configured: a resumed job moves it again
        return state

    def load_state_dict(self, state) -> None:
        self.synchronize()
        self.optimizer.load_state_dict(state)
        if getattr(self.strategy, "momentum", 0.0):
            for group in self.optimizer.param_groups:
                group["momentum"] = 0.0  # still held by the sparsifier (momentum correction)
        if self.pto is not None:
            self.pto.load_from(self.optimizer)
            self.optimizer.state.clear()

    def close(self) -> None:
        """Apply what is owed, stop the strategy's threads and free its communicators."""
        self.synchronize()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.gate.remove()
        self.strategy.close()
        if self.pto is not None:
            self.pto.close()
        if self._own_topology:
            self.topology.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _take_sgd_momentum(optimizer) -> float:
    """Move an SGD's momentum into the sparsifier (momentum correction): the SGD continues without it.

    Returns 0 for other optimizers, which keep their own state.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return 0.0
    groups = optimizer.param_groups
    momenta = {g["momentum"] for g in groups}
    if momenta == {0}:
        return 0.0
    if len(momenta) > 1 or any(g["nesterov"] or g["dampening"] for g in groups):
        raise ValueError("momentum correction needs one plain momentum for all parameter groups (no nesterov, "
                         "no dampening); pass sparse_options={'momentum_correction': False} to keep the SGD's")
    for g in groups:
        g["momentum"] = 0.0
    return float(momenta.pop())


@contextlib.contextmanager
def _grads_hidden(pairs):
    """Optimizers skip parameters whose .grad is None: hide these for the duration."""
    for p, _ in pairs:
        p.grad = None
    try:
        yield
    finally:
        for p, g in pairs:
            p.grad = g


@contextlib.contextmanager
def _hyperparameters(optimizer, hyper):
    saved = [{k: g[k] for k in h if k in g} for g, h in zip(optimizer.param_groups, hyper)]
    for g, h in zip(optimizer.param_groups, hyper):
        g.update(h)
    try:
        yield
    finally:
        for g, s in zip(optimizer.param_groups, saved):
            g.update(s)
