"""PTO (MSTopK paper): each rank updates its 1/P of the parameters and optimizer state, then an allgather."""

from __future__ import annotations

import copy
import inspect
from itertools import accumulate

import torch

from mpicomm import IN_PLACE, Ring, block_counts, wait_all
from mpicomm.agree import check_same_structure, fail_together


class ShardedUpdate:
    """Apply `optimizer`'s update to this rank's shard of `params` only, then allgather the parameters.

        pto = ShardedUpdate(optimizer, params, comm)
        ... average the gradients (allreduce into p.grad, or reduce-scatter) ...
        pto.step()               # or pto.step(grad_shard) with this rank's averaged slice
        pto.consolidate_into(optimizer); torch.save(optimizer.state_dict(), ...)   # checkpoint
        optimizer.load_state_dict(...); pto.load_from(optimizer)                   # resume

    `params` (same order and shapes on every rank, one dtype, CPU) are viewed
    as one flat vector of n elements; rank r owns elements
    [`shard`[0], `shard`[1]), block r of `block_counts(n, P)`, so a shard may
    cut through tensors. A private optimizer of the same class holds one leaf
    tensor per param group of `optimizer` (that group's elements inside the
    shard) with the group's hyper-parameters, re-copied before every step so
    that schedulers are honoured; only it holds optimizer state, 1/P of the
    total. `optimizer` itself is used for its hyper-parameters and as the
    unsharded state container for checkpoints; it is never stepped.

    The result equals an unsharded `optimizer.step()` on every rank only when
    the update is elementwise within a parameter (SGD with momentum, weight
    decay, nesterov; Adam; AdamW; ...). Optimizers that use per-tensor
    quantities (LAMB's and LARS's trust ratios, Adafactor's factored moments,
    gradient-norm clipping inside the optimizer) would compute them over the
    shard pieces instead of whole tensors and give different results.

    Gradients that are None count as zeros (every parameter is updated every
    step, as the data-parallel strategies do). The model parameters are the
    source of truth: parameters changed between steps (loaded weights,
    in-place edits) are re-read into the shard; see `refresh` for the writes
    that cannot be noticed.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], comm):
        self.optimizer = optimizer
        self.params = list(params)
        # Everything checked here is the same on every rank, so every rank raises alike before
        # any collective (the Ring's Dup) is entered.
        self._members = _group_members(optimizer, self.params)
        self._layout = _group_layout(optimizer)
        dtypes = sorted({str(p.dtype) for p in self.params})
        if len(dtypes) != 1:
            raise TypeError(f"ShardedUpdate needs parameters of one dtype, got {', '.join(dtypes)} "
                            "(use one ShardedUpdate per dtype)")
        devices = sorted({str(p.device) for p in self.params if p.device.type != "cpu"})
        if devices:
            raise ValueError(f"ShardedUpdate works on CPU tensors only, got parameters on {', '.join(devices)}")
        self.dtype = self.params[0].dtype
        self.numels = [p.numel() for p in self.params]
        self.offsets = list(accumulate(self.numels, initial=0))
        self.numel = self.offsets[-1]

        self.ring = Ring(comm)
        self.rank, self.size = self.ring.rank, self.ring.size
        self.counts = block_counts(self.numel, self.size)
        bounds = list(accumulate(self.counts, initial=0))
        self._bounds = list(zip(bounds[:-1], bounds[1:]))
        start, stop = self._bounds[self.rank]

        # The allgather target: block r is this rank's shard, which the leaves below live in
        # when they can, so the update writes straight into what is sent.
        self.flat = torch.empty(self.numel, dtype=self.dtype)
        self._mine = self.flat[start:stop]
        self._grad = torch.empty(stop - start, dtype=self.dtype)
        # (param index, first, last element inside the param, position in the shard) of each
        # parameter that overlaps this rank's shard.
        self._pieces = []
        for i, (a, z) in enumerate(zip(self.offsets[:-1], self.offsets[1:])):
            lo, hi = max(a, start), min(z, stop)
            if lo < hi:
                self._pieces.append((i, lo - a, hi - a, lo - start))
        self._leaves = [_Leaf(self._segments(m), self._mine) for m in self._members]
        # Elements of each group held by each rank: the counts of the state allgathers.
        self._group_counts = [[sum(_overlap(self.offsets[i], self.offsets[i + 1], s, e) for i in m)
                               for s, e in self._bounds] for m in self._members]
        self._written = [None] * len(self.params)  # see _read_params
        self._opt = self._make_optimizer([dict(self._hyper(g), params=[leaf.tensor])
                                          for g, leaf in zip(optimizer.param_groups, self._leaves)])

    # -- layout ----------------------------------------------------------------
    @property
    def shard(self) -> tuple[int, int]:
        """(start, stop): the elements of the flat parameter vector this rank updates."""
        return self._bounds[self.rank]

    def _pieces_of(self, members):
        """The pieces (see _pieces) of these parameters, in flat order."""
        members = set(members)
        return [piece for piece in self._pieces if piece[0] in members]

    def _segments(self, members):
        """[lo, hi) runs of the shard holding a group's elements, in flat order, adjacent ones merged."""
        segs = []
        for _, a, z, pos in self._pieces_of(members):
            if segs and segs[-1][1] == pos:
                segs[-1] = (segs[-1][0], pos + z - a)
            else:
                segs.append((pos, pos + z - a))
        return segs

    def _make_optimizer(self, groups):
        cls = type(self.optimizer)
        sig = inspect.signature(cls.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values()):
            kwargs = dict(self.optimizer.defaults)
        else:
            # defaults can hold keys the constructor does not take (AdamW's decoupled_weight_decay);
            # the groups carry every hyper-parameter anyway.
            kwargs = {k: v for k, v in self.optimizer.defaults.items() if k in sig}
        return cls(groups, **kwargs)

    @staticmethod
    def _hyper(group) -> dict:
        return {k: v for k, v in group.items() if k != "params"}

    def _check_same_groups(self, optimizer) -> None:
        if _group_layout(optimizer) == self._layout:
            return  # the usual case, every step: the very same parameter objects in the same groups
        try:
            same, why = _group_members(optimizer, self.params) == self._members, "parameters moved between groups"
        except ValueError as exc:
            same, why = False, str(exc)
        if not same:
            raise ValueError(f"the optimizer's param groups changed since ShardedUpdate was built: {why}")

    # -- the update ----------------------------------------------------------------
    def step(self, grad_shard: torch.Tensor | None = None) -> None:
        """One optimizer step: update this rank's shard, then allgather so every rank has all parameters.

        grad_shard None: the averaged gradients are read from each param's .grad
        (None as zeros). Otherwise it is the averaged gradient of exactly this
        rank's shard (stop - start elements), e.g. a reduce-scatter's output.
        """
        self.update_shard(grad_shard)
        self.allgather_params()

    def update_shard(self, grad_shard: torch.Tensor | None = None) -> None:
        """The first half of `step`: run the private optimizer on this rank's shard (no communication)."""
        self._check_same_groups(self.optimizer)
        for sg, ug in zip(self._opt.param_groups, self.optimizer.param_groups):
            sg.update(self._hyper(ug))
        start, stop = self.shard
        with torch.no_grad():
            self._read_params()
            if grad_shard is None:
                grad = self._grad
                for i, a, z, pos in self._pieces:
                    g = self.params[i].grad
                    if g is None:
                        grad[pos:pos + z - a].zero_()
                    else:
                        grad[pos:pos + z - a] = g.detach().reshape(-1)[a:z]
            else:
                if grad_shard.numel() != stop - start:
                    raise ValueError(f"grad_shard has {grad_shard.numel()} elements, rank {self.rank}'s shard "
                                     f"[{start}, {stop}) has {stop - start}")
                grad = grad_shard.detach().reshape(-1)
                if grad.dtype != self.dtype:
                    grad = grad.to(self.dtype)
            for leaf in self._leaves:
                leaf.set_grad(grad)
        self._opt.step()
        with torch.no_grad():
            for leaf in self._leaves:
                leaf.write_shard(self._mine)

    def allgather_params(self) -> None:
        """The second half of `step`: gather every rank's updated shard and copy it into the parameters."""
        self.ring.allgatherv(IN_PLACE, self.flat, counts=self.counts).wait()
        with torch.no_grad():
            for p, a, z in zip(self.params, self.offsets[:-1], self.offsets[1:]):
                p.copy_(self.flat[a:z].view(p.shape))
        self._written = [_identity(p) for p in self.params]

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
        stale = False
        for i, a, z, pos in self._pieces:
            if self._written[i] != _identity(self.params[i]):
                self._mine[pos:pos + z - a] = self.params[i].detach().reshape(-1)[a:z]
                stale = True
        if stale:
            for leaf in self._leaves:
                leaf.read_shard(self._mine)

    # -- checkpoints -----------------------------------------------------------------
    def consolidate_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective: write the sharded state into `optimizer.state`, per parameter, unsharded.

        Afterwards `optimizer.state_dict()` is what the unsharded optimizer
        would hold (e.g. SGD's momentum_buffer, Adam's step/exp_avg/exp_avg_sq)
        on every rank. Per-element state is allgathered; scalar state (Adam's
        step) must be equal on all ranks, as it is when all ranks step together.
        """
        self._check_same_groups(optimizer)
        entries, problem = [], None
        for gi, leaf in enumerate(self._leaves):
            for k, v in self._opt.state.get(leaf.tensor, {}).items():
                kind = _kind(v, leaf.numel)
                if kind == "other":
                    problem = f"param group {gi}: state {k!r} is neither per-element nor a scalar"
                elif kind == "elem":
                    entries.append(f"group {gi} {k}: per-element {v.dtype}")
                else:
                    entries.append(f"group {gi} {k} = {float(v)!r}")
        # The same keys everywhere (so the allgathers below pair up), and the same scalars
        # (a rank that skipped a step would make the merged state a lie).
        fail_together(self.ring.comm, problem, ValueError)
        check_same_structure(self.ring.comm, entries, "optimizer state")

        # All in flight together; each gathers one group's elements of one state, in flat order.
        handles = [self.ring.allgatherv(v, torch.empty(sum(counts), dtype=v.dtype), counts=counts)
                   for leaf, counts in zip(self._leaves, self._group_counts)
                   for v in self._opt.state.get(leaf.tensor, {}).values() if _kind(v, leaf.numel) == "elem"]
        gathered = iter(wait_all(handles))
        for leaf, members in zip(self._leaves, self._members):
            state = self._opt.state.get(leaf.tensor, {})
            full = {k: next(gathered) for k, v in state.items() if _kind(v, leaf.numel) == "elem"}
            pos = 0
            for i in members:
                p = self.params[i]
                entry = {}
                for k, v in state.items():
                    if k in full:
                        entry[k] = torch.empty_like(p, dtype=v.dtype)  # the param's memory format, like zeros_like
                        entry[k].copy_(full[k][pos:pos + p.numel()].view(p.shape))
                    else:
                        entry[k] = v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
                pos += p.numel()
                if entry:
                    optimizer.state[p] = entry
                else:
                    optimizer.state.pop(p, None)

    def load_from(self, optimizer: torch.optim.Optimizer) -> None:
        """(Re)initialise the shard's optimizer state from `optimizer`'s unsharded state (for --resume).

        Local: every rank must hold the same unsharded state (e.g. loaded from
        the same checkpoint) and picks out its own shard. A group without state
        starts fresh. `optimizer.state` can be cleared afterwards to save memory.
        The shard's parameter values are re-read from the model too.
        """
        self._check_same_groups(optimizer)
        self.refresh()
        for gi, (leaf, members) in enumerate(zip(self._leaves, self._members)):
            states = [optimizer.state.get(self.params[i]) or {} for i in members]
            if not any(states):
                self._opt.state.pop(leaf.tensor, None)
                continue
            keys = list(states[0])
            if any(list(s) != keys for s in states):
                raise ValueError(f"param group {gi}: parameters hold different optimizer state keys "
                                 "(some without state?); the sharded state needs one layout per group")
            elementwise = self._elementwise_keys(optimizer.param_groups[gi])
            new = {}
            for k in keys:
                values = [s[k] for s in states]
                if k in elementwise:
                    new[k] = self._shard_of(gi, k, dict(zip(members, values)), leaf)
                else:
                    first = values[0]
                    if any(not _same_value(v, first) for v in values[1:]):
                        raise ValueError(f"param group {gi}: state {k!r} differs between parameters, "
                                         "so it cannot be shared by the group's shard")
                    new[k] = first.clone() if torch.is_tensor(first) else copy.deepcopy(first)
            self._opt.state[leaf.tensor] = new

    def _shard_of(self, gi, key, values: dict, leaf):
        """This rank's elements of one per-element state ({param index: tensor}), laid out like the group's leaf."""
        for i, v in values.items():
            if not torch.is_tensor(v) or v.numel() != self.numels[i]:
                raise ValueError(f"param group {gi}: state {key!r} of parameter #{i} is not a tensor of "
                                 f"{self.numels[i]} elements")
        out = torch.empty(leaf.numel, dtype=next(iter(values.values())).dtype)
        pos = 0
        for i, a, z, _ in self._pieces_of(values):
            out[pos:pos + z - a] = values[i].detach().reshape(-1)[a:z]
            pos += z - a
        return out

    def _elementwise_keys(self, group) -> set:
        """Which state keys this optimizer keeps per element, found by stepping a throwaway 2-element tensor.

        Shapes alone cannot tell for a 0-dim parameter, whose exp_avg is as
        0-dim as Adam's step.
        """
        probe = torch.zeros(2, dtype=self.dtype)
        probe.grad = torch.zeros(2, dtype=self.dtype)
        opt = self._make_optimizer([dict(self._hyper(group), params=[probe])])
        opt.step()
        return {k for k, v in opt.state[probe].items() if _kind(v, 2) == "elem"}

    def close(self) -> None:
        """Free the ring's communicator (collective)."""
        self.ring.free()

    def __enter__(self) -> "ShardedUpdate":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Leaf:
    """One param group's part of the shard as a single tensor the private optimizer steps.

    When the group's elements are one run of the shard, the leaf is a view of
    it and nothing is copied; otherwise (groups interleaved in parameter
    order, e.g. weights with decay and biases without) it is its own tensor
    gathered from and scattered back to the runs.
    """

    def __init__(self, segments, shard: torch.Tensor):
        self.segments = segments
        self.numel = sum(z - a for a, z in segments)
        self.is_view = len(segments) <= 1
        if segments and self.is_view:
            self.tensor = shard[segments[0][0]:segments[0][1]]
        else:
            self.tensor = torch.empty(self.numel, dtype=shard.dtype)
        self._grad = None if self.is_view else torch.empty_like(self.tensor)

    def read_shard(self, shard) -> None:
        if not self.is_view:
            torch.cat([shard[a:z] for a, z in self.segments], out=self.tensor)

    def write_shard(self, shard) -> None:
        if not self.is_view:
            for (a, z), part in zip(self.segments, self.tensor.split([z - a for a, z in self.segments])):
                shard[a:z] = part

    def set_grad(self, grad) -> None:
        if self.is_view:
            a, z = self.segments[0] if self.segments else (0, 0)
            self.tensor.grad = grad[a:z]
        else:
            torch.cat([grad[a:z] for a, z in self.segments], out=self._grad)
            self.tensor.grad = self._grad


def _group_members(optimizer, params) -> list[list[int]]:
    """Per param group, the indices into `params` of its parameters in `params` order; raise on a mismatch."""
    index = {}
    for i, p in enumerate(params):
        if id(p) in index:
            raise ValueError(f"parameter #{i} appears twice in params (tied weights must be listed once)")
        index[id(p)] = i
    if not params:
        raise ValueError("ShardedUpdate needs at least one parameter")
    members, seen = [], set()
    for gi, g in enumerate(optimizer.param_groups):
        idx = []
        for p in g["params"]:
            if id(p) not in index and not p.requires_grad:
                continue  # a frozen parameter: no gradient, never updated, as in the unsharded step
            if id(p) not in index:
                raise ValueError(f"param group {gi} of the optimizer holds a parameter of shape {tuple(p.shape)} "
                                 "that is not in ShardedUpdate's params")
            idx.append(index[id(p)])
        members.append(sorted(idx))
        seen.update(idx)
    missing = [i for i in range(len(params)) if i not in seen]
    if missing:
        raise ValueError(f"params #{missing} (shapes {[tuple(params[i].shape) for i in missing]}) are in no param "
                         "group of the optimizer: every parameter ShardedUpdate updates must be in exactly one")
    return members


def _group_layout(optimizer) -> tuple:
    """Which parameter objects sit in which group, cheap to compare every step."""
    return tuple(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups)


def _identity(p: torch.Tensor) -> tuple[int, int]:
    """Storage and version counter: equal as long as nothing wrote to the parameter in place or replaced it."""
    return p.data_ptr(), p._version


def _overlap(a: int, z: int, s: int, e: int) -> int:
    return max(0, min(z, e) - max(a, s))


def _kind(value, numel: int) -> str:
    """'elem' for per-element state of a 1-d leaf of `numel` elements, 'scalar' for a number, else 'other'."""
    if torch.is_tensor(value):
        if value.dim() == 1 and value.numel() == numel:
            return "elem"
        return "scalar" if value.dim() == 0 else "other"
    return "scalar" if isinstance(value, (int, float)) else "other"


def _same_value(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b
