"""PTO (MSTopK paper): each rank updates its 1/P of the parameters and optimizer state, then an allgather."""

from __future__ import annotations

import copy
import inspect
from itertools import accumulate

import torch

from mpicomm import IN_PLACE, Collectives, Ring, block_counts
from mpicomm.agree import fail_together

from ..emulate.accelerator import active as emulated_accelerator
from ..emulate.emulated import optimizer_state
from ..grad_buffers import memory_order
from .groups import group_layout, group_members, identity
from .state import host_hyper, laid_out_like, placed_like_optimizer, same_value, state_kind
from .transfers import ShardTransfers


class ShardedUpdate:
    """Apply `optimizer`'s update to this rank's shard of `params` only, then allgather the parameters.

        pto = ShardedUpdate(optimizer, params, comm)
        ... average the gradients (allreduce into p.grad, or reduce-scatter) ...
        pto.step()               # or pto.step(grad_shard) with this rank's averaged slice
        pto.consolidate_into(optimizer); torch.save(optimizer.state_dict(), ...)   # checkpoint
        optimizer.load_state_dict(...); pto.load_from(optimizer)                   # resume

    `params` (same order and shapes on every rank, one dtype) are viewed
    as one flat vector of n elements, each parameter in its memory order (as
    the gradient buffers lay it out); rank r owns elements [`shard`[0],
    `shard`[1]), block r of `block_counts(n, P)`, so a shard may cut through
    tensors. Each piece of a parameter inside the shard is a view of the
    shard that a private optimizer of the same class steps, in the param
    group of its parameter, with that group's hyper-parameters re-copied
    before every step (schedulers are honoured). Only the private optimizer
    holds state, 1/P of the total and per piece, so per-parameter state such
    as Adam's step count stays per parameter. `optimizer` itself is used for
    its hyper-parameters and as the unsharded state container for
    checkpoints; it is never stepped.

    The result equals an unsharded `optimizer.step()` on every rank only when
    the update is elementwise within a parameter (SGD with momentum, weight
    decay, nesterov; Adam; AdamW; ...). Optimizers that use per-tensor
    quantities (LAMB's and LARS's trust ratios, Adafactor's factored moments,
    gradient-norm clipping inside the optimizer) would compute them over the
    pieces instead of whole tensors and give different results.

    `step(skip=...)` leaves parameters out, as an unsharded step leaves out a
    parameter whose .grad is None. The model parameters are the source of
    truth: parameters changed between steps (loaded weights, in-place edits)
    are re-read into the shard; see `refresh` for the writes that cannot be
    noticed.

    The shard, its optimizer state and the allgather live in host memory
    whatever the parameters' device: MPI works on the host. The private
    optimizer runs there with `capturable` off (a CUDA-graph setting of the
    device's optimizer; the update is the same). With a GPU model the
    shard's gradient is gathered with one batched copy and one wait (none if
    `grads` are host tensors, as the staged mirror is), and the gathered
    parameters go back from pinned memory without a wait, on the current
    stream, ahead of the next forward pass (runtime.pto.transfers; state
    tensors loaded from a GPU optimizer are moved to the host).

    Under emulated compute (runtime.emulate) the shard's update waits the
    device's modelled optimizer time for its elements (kind "optimizer", as
    PTO runs it on the GPU in the MSTopK paper) instead of stepping, and the
    gathered parameters' copy back to the device waits its modelled time
    (kind "h2d") instead of copying; the allgather is real. The pieces'
    optimizer then holds no state, and the parameters keep their values
    (every rank's shard holds them already).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], comm, topology=None):
        self.optimizer = optimizer
        self.params = list(params)
        # Everything checked here is the same on every rank, so every rank raises alike before
        # any collective (the Ring's Dup) is entered.
        self._members = group_members(optimizer, self.params)
        self._layout = group_layout(optimizer)
        dtypes = sorted({str(p.dtype) for p in self.params})
        if len(dtypes) != 1:
            raise TypeError(f"ShardedUpdate needs parameters of one dtype, got {', '.join(dtypes)} "
                            "(use one ShardedUpdate per dtype)")
        self.dtype = self.params[0].dtype
        self.numels = [p.numel() for p in self.params]
        self.offsets = list(accumulate(self.numels, initial=0))
        self.numel = self.offsets[-1]

        # With the Topology of `comm` (DistributedOptimizer's), the parameters' allgather takes the hierarchy on
        # several nodes of several ranks, as the gradients' reduce-scatter does (mpicomm.Collectives).
        self.ring = Collectives(topology) if topology is not None else Ring(comm)
        self.rank, self.size = self.ring.rank, self.ring.size
        self.counts = block_counts(self.numel, self.size)
        bounds = list(accumulate(self.counts, initial=0))
        self._bounds = list(zip(bounds[:-1], bounds[1:]))
        start, stop = self._bounds[self.rank]

        # The allgather target: block r is this rank's shard, which the pieces are views of,
        # so the update writes straight into what is sent. Pinned for a GPU model (copies without a wait).
        self.transfers = ShardTransfers(self.params)
        self.flat = self.transfers.host(self.numel, self.dtype)
        self._mine = self.flat[start:stop]
        self._grad = self.transfers.host(stop - start, self.dtype)
        # (param index, first, last element inside the param, position in the shard) of each
        # parameter that overlaps this rank's shard, and the shard view the optimizer steps.
        self._pieces = []
        for i, (a, z) in enumerate(zip(self.offsets[:-1], self.offsets[1:])):
            lo, hi = max(a, start), min(z, stop)
            if lo < hi:
                self._pieces.append((i, lo - a, hi - a, lo - start))
        self._leaves = [self._mine[pos:pos + z - a] for _, a, z, pos in self._pieces]
        group_of = {i: gi for gi, m in enumerate(self._members) for i in m}
        self._written = [None] * len(self.params)  # see _read_params
        self._opt = self._make_optimizer([
            dict(self._hyper(g), params=[leaf for (i, *_), leaf in zip(self._pieces, self._leaves)
                                         if group_of[i] == gi])
            for gi, g in enumerate(optimizer.param_groups)])

    # -- layout ----------------------------------------------------------------
    @property
    def shard(self) -> tuple[int, int]:
        """(start, stop): the elements of the flat parameter vector this rank updates."""
        return self._bounds[self.rank]

    def _make_optimizer(self, groups):
        cls = type(self.optimizer)
        sig = inspect.signature(cls.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values()):
            kwargs = host_hyper(self.optimizer.defaults)
        else:
            # defaults can hold keys the constructor does not take (AdamW's decoupled_weight_decay);
            # the groups carry every hyper-parameter anyway.
            kwargs = {k: v for k, v in host_hyper(self.optimizer.defaults).items() if k in sig}
        return cls(groups, **kwargs)

    @staticmethod
    def _hyper(group) -> dict:
        return host_hyper(group)

    def _check_same_groups(self, optimizer) -> None:
        if group_layout(optimizer) == self._layout:
            return  # the usual case, every step: the very same parameter objects in the same groups
        try:
            same, why = group_members(optimizer, self.params) == self._members, "parameters moved between groups"
        except ValueError as exc:
            same, why = False, str(exc)
        if not same:
            raise ValueError(f"the optimizer's param groups changed since ShardedUpdate was built: {why}")

    # -- the update ----------------------------------------------------------------
    def step(self, grad_shard: torch.Tensor | None = None, skip=(), grads=None) -> None:
        """One optimizer step: update this rank's shard, then allgather so every rank has all parameters.

        grad_shard None: the averaged gradients are read from `grads`, one
        tensor per parameter in its memory order (default: each param's .grad,
        None as zeros). Otherwise it is the averaged gradient of exactly this
        rank's shard (stop - start elements), e.g. a reduce-scatter's output.
        skip: indices of parameters to leave untouched (no rank produced a
        gradient for them), state included.
        """
        self.update_shard(grad_shard, skip, grads)
        self.allgather_params()

    def update_shard(self, grad_shard: torch.Tensor | None = None, skip=(), grads=None) -> None:
        """The first half of `step`: run the private optimizer on this rank's shard (no communication)."""
        self._check_same_groups(self.optimizer)
        for sg, ug in zip(self._opt.param_groups, self.optimizer.param_groups):
            sg.update(self._hyper(ug))
        start, stop = self.shard
        skip = set(skip)
        acc = emulated_accelerator()
        if acc is not None:
            with torch.no_grad():
                self._read_params()  # what the allgather sends: the first step only, unless weights were loaded
            stepped = [z - a for i, a, z, _ in self._pieces if i not in skip]
            acc.issue("optimizer", acc.model.optimizer_s(sum(stepped), len(stepped), optimizer_state(self.optimizer)))
            return
        with torch.no_grad():
            self.transfers.host_free()  # the last parameters' copy to the device has read the shard
            self._read_params()
            if grad_shard is None:
                grad = self._grad
                sources = [(None if g is None else memory_order(g.detach())[a:z], pos) for (i, a, z, pos), g in
                           zip(self._pieces, self._grads_of(grads))]
                self.transfers.gather(sources, grad, [z - a for _, a, z, _ in self._pieces])
            else:
                if grad_shard.numel() != stop - start:
                    raise ValueError(f"grad_shard has {grad_shard.numel()} elements, rank {self.rank}'s shard "
                                     f"[{start}, {stop}) has {stop - start}")
                grad = grad_shard.detach().reshape(-1)
                if grad.dtype != self.dtype:
                    grad = grad.to(self.dtype)
            for (i, a, z, pos), leaf in zip(self._pieces, self._leaves):
                leaf.grad = None if i in skip else grad[pos:pos + z - a]
        self._opt.step()

    def _grads_of(self, grads) -> list:
        """Each piece's parameter's gradient: from `grads` (one tensor per parameter) or .grad."""
        if grads is None:
            return [self.params[i].grad for i, *_ in self._pieces]
        if len(grads) != len(self.params):
            raise ValueError(f"grads holds {len(grads)} tensors for {len(self.params)} parameters")
        return [grads[i] for i, *_ in self._pieces]

    def allgather_params(self) -> None:
        """The second half of `step`: gather every rank's updated shard and copy it into the parameters."""
        self.transfers.host_free()
        self.ring.allgatherv(IN_PLACE, self.flat, counts=self.counts).wait()
        acc = emulated_accelerator()
        if acc is not None:  # the parameters did not change (no update ran): only the copy's time is owed
            acc.issue("h2d", acc.model.copy_s(self.numel * self.flat.element_size()))
            self._written = [identity(p) for p in self.params]
            return
        with torch.no_grad():
            self.transfers.to_params([memory_order(p.detach()) for p in self.params],
                                     [self.flat[a:z] for a, z in zip(self.offsets[:-1], self.offsets[1:])])
        self._written = [identity(p) for p in self.params]

    def refresh(self) -> None:
        """Re-read the whole shard from the parameters at the next step.

        Only needed after writes that autograd's version counter does not see
        (`p.data.copy_(...)`, writes through numpy or MPI buffer views); ordinary
        in-place writes (load_state_dict, torch.no_grad() ops) are noticed.
        """
        self._written = [None] * len(self.params)

    def _read_params(self) -> None:
        """Copy into the shard the parameters written since our last allgather.

        The parameters are the source of truth, but re-reading the shard every
        step would cost a copy of n/P elements; a parameter whose storage and
        version counter are those we left it with still holds our values.
        """
        for i, a, z, pos in self._pieces:
            if self._written[i] != identity(self.params[i]):
                self._mine[pos:pos + z - a] = memory_order(self.params[i].detach())[a:z]

    # -- checkpoints -----------------------------------------------------------------
    def consolidate_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective: write the sharded state into `optimizer.state`, per parameter, unsharded.

        Afterwards `optimizer.state_dict()` is what the unsharded optimizer
        would hold (e.g. SGD's momentum_buffer, Adam's step/exp_avg/exp_avg_sq)
        on every rank. Per-element state is allgathered; scalar state (Adam's
        step) must be equal in every piece of a parameter, as it is when all
        ranks step together.
        """
        self._check_same_groups(optimizer)
        # What each rank's pieces hold, per parameter: scalars by value, per-element state by dtype.
        mine, problem = {}, None
        for (i, a, z, _), leaf in zip(self._pieces, self._leaves):
            info = mine.setdefault(i, {})
            for k, v in self._opt.state.get(leaf, {}).items():
                kind = state_kind(v, z - a)
                if kind == "other":
                    problem = f"parameter #{i}: state {k!r} is neither per-element nor a scalar"
                info[k] = ("elem", str(v.dtype)) if kind == "elem" else ("scalar", v)
        fail_together(self.ring.comm, problem, ValueError)
        merged: dict = {}
        for r, infos in enumerate(self.ring.comm.allgather(mine)):  # checkpoints only: pickling is fine
            for i, info in infos.items():
                entry = merged.setdefault(i, {})
                for k, v in info.items():
                    if k in entry and not same_value(entry[k][1], v[1]):
                        problem = (f"parameter #{i}: state {k!r} differs between its pieces "
                                   f"({entry[k][1]!r} vs {v[1]!r} on rank {r}); did a rank skip a step?")
                    entry[k] = v
        if problem:
            raise ValueError(problem)
        # One allgather per per-element key: the shard with each piece's state (zeros where a piece has none).
        keys = sorted({(k, dtype) for e in merged.values() for k, (kind, dtype) in e.items() if kind == "elem"})
        full = {}
        for k, dtype in keys:
            local = torch.zeros(self._mine.numel(), dtype=getattr(torch, dtype.removeprefix("torch.")))
            for (i, a, z, pos), leaf in zip(self._pieces, self._leaves):
                v = self._opt.state.get(leaf, {}).get(k)
                if v is not None:
                    local[pos:pos + z - a] = v
            full[k] = self.ring.allgatherv(local, torch.empty(self.numel, dtype=local.dtype), counts=self.counts).wait()
        group_of = {i: gi for gi, m in enumerate(self._members) for i in m}
        for i, p in enumerate(self.params):
            entry = {}
            for k, (kind, value) in merged.get(i, {}).items():  # the optimizer's own key order
                if kind == "elem":
                    entry[k] = torch.empty_like(p, dtype=full[k].dtype)  # the param's memory format
                    memory_order(entry[k]).copy_(full[k][self.offsets[i]:self.offsets[i + 1]])
                else:
                    entry[k] = placed_like_optimizer(k, value.clone(), p, optimizer.param_groups[group_of[i]]) \
                        if torch.is_tensor(value) else copy.deepcopy(value)
            if entry:
                optimizer.state[p] = entry
            else:
                optimizer.state.pop(p, None)

    def load_from(self, optimizer: torch.optim.Optimizer) -> None:
        """(Re)initialise the pieces' optimizer state from `optimizer`'s unsharded state (for --resume).

        Local: every rank must hold the same unsharded state (e.g. loaded from
        the same checkpoint) and picks out its own pieces. A parameter without
        state starts fresh. `optimizer.state` can be cleared afterwards to save
        memory. The shard's parameter values are re-read from the model too.
        """
        self._check_same_groups(optimizer)
        self.refresh()
        group_of = {i: gi for gi, m in enumerate(self._members) for i in m}
        elementwise = [self._elementwise_keys(g) for g in optimizer.param_groups]
        for (i, a, z, _), leaf in zip(self._pieces, self._leaves):
            state = optimizer.state.get(self.params[i]) or {}
            if not state:
                self._opt.state.pop(leaf, None)
                continue
            piece = {}
            for k, v in state.items():
                if k in elementwise[group_of[i]]:
                    if not torch.is_tensor(v) or v.numel() != self.numels[i]:
                        raise ValueError(f"parameter #{i}: state {k!r} is not a tensor of {self.numels[i]} elements")
                    piece[k] = memory_order(laid_out_like(v, self.params[i]))[a:z].to("cpu", copy=True)
                else:
                    piece[k] = v.detach().to("cpu", copy=True) if torch.is_tensor(v) else copy.deepcopy(v)
            self._opt.state[leaf] = piece

    def _elementwise_keys(self, group) -> set:
        """Which state keys this optimizer keeps per element, found by stepping a throwaway 2-element tensor.

        Shapes alone cannot tell for a 0-dim parameter, whose exp_avg is as
        0-dim as Adam's step.
        """
        probe = torch.zeros(2, dtype=self.dtype)
        probe.grad = torch.zeros(2, dtype=self.dtype)
        opt = self._make_optimizer([dict(self._hyper(group), params=[probe])])
        opt.step()
        return {k for k, v in opt.state[probe].items() if state_kind(v, 2) == "elem"}

    def close(self) -> None:
        """Free the ring's communicator (collective)."""
        self.ring.free()

    def __enter__(self) -> "ShardedUpdate":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

