"""Top-k sparsified gradient exchange with error feedback: flat (`topk`) and hierarchical (`hier-topk`)."""

from __future__ import annotations

import math

import torch

from mpicomm import Ring
from mpicomm.sparse_allreduce import SparseAllreduce

from ..emulate.accelerator import active as emulated_accelerator
from ..strategy import Strategy, StrategyContext, wait_handles
from .emulated import EmulatedSelection
from .error_feedback import DensitySchedule, ErrorFeedback
from .mstopk import MSTopK
from .selection import exact_topk, k_for_density


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf; raised on every rank, naming the rank and the layer."""


class TopkSync(Strategy):
    """Each step sends only the largest `density` fraction of the (error-compensated) gradient.

    Not exact SGD: the unsent remainder waits in a per-rank residual (error
    feedback) and joins later steps. `warmup_steps` dense steps and a DGC-style
    ramp of `ramp_steps` ease the start. Selection runs over each dtype's flat
    gradient buffer (`granularity="model"`, one exchange per dtype per step)
    or per parameter (`"layer"`, k per layer). Before the exchange every rank
    reports whether its gradients are finite (in the per-step agreement), so a
    bad layer is named on every rank instead of spreading.

    ctx.momentum > 0 is DGC's momentum correction (the optimizer wrapper moves
    an SGD's momentum here and runs the SGD without it): each rank keeps its
    velocity u = m*u + g and u, not g, is what gets sparsified, so what waits
    in the residual is not amplified again by the optimizer's momentum; with
    `momentum_masking` u is then cleared where entries were applied. By
    linearity, at density 1 or in dense warm-up steps this is exactly
    momentum SGD, except for parameters no rank used in a step: their velocity
    keeps moving them, where torch's SGD would skip them.

    State (`state_dict`): the step counter (warm-up and ramp), and per rank the
    residuals and velocities (saved as CPU tensors).

    on_device: the strategy works on the gradients where they live
    (`buffers.device_flats`): with a GPU model the selection, the residuals
    and the velocity stay on the GPU, and only the (index, value) pairs cross
    to the host for the exchange and back (see SparseAllreduce, staged), in
    one copy per buffer (with granularity="layer", every layer's pairs
    together: the host waits for the device once per buffer). The
    averaged gradient is in `device_flats` when finish() returns (queued on
    the current stream, ahead of the optimizer's update).

    Under emulated compute (runtime.emulate) the device's part waits its
    modelled time instead: the selection with its error feedback and velocity
    (runtime.sparse.emulated), the copies the staged path makes, and the
    dense passes over the gradient (the finiteness check, zeroing the result,
    the division by the ranks: each a pass a GPU makes at its memory's rate,
    which on this host's memory cost a rank of VGG-19 ~170 ms a step), and the
    sum of every rank's pairs into the result ("sparse sum", P * k entries
    scattered into the model-sized result: 4 ranks' pairs into ResNet-50's
    102 MB took ~7 ms of a host core a step here, the V100 model's 36 us). The
    exchange is real: every rank's pairs cross the links and are gathered,
    not summed; the landed gradients keep their values, as nothing reads the
    sum when the update is emulated.
    """

    name = "topk"
    hierarchical = False
    exact = False
    on_device = True

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        o = ctx.options
        for p, name in zip(self.params, ctx.names):
            if p.element_size() not in (4, 8) or not p.is_floating_point():
                raise TypeError(f"{self.name} sends indices at the values' width and needs float32/float64 "
                                f"parameters; {name} is {p.dtype}")
        self.schedule = DensitySchedule(o.density, o.warmup_steps, o.ramp_steps)
        self.granularity = o.granularity
        self.ef = ErrorFeedback(MSTopK() if o.operator == "mstopk" else exact_topk, enabled=o.error_feedback)
        self.staged = self.buffers.staged
        self.sparse = SparseAllreduce(ctx.topology, hierarchical=self.hierarchical, validate=False,
                                      policy=ctx.policy, interrupt=ctx.interrupt, staged=self.staged)
        self.dense = Ring(ctx.topology.world, validate=False)
        self.momentum, self.masking = ctx.momentum, o.momentum_masking
        self.velocity: list | None = None  # made on first use (_velocities): an emulated run never reads it
        self.steps = 0
        self._handles: list = []
        self._emulated: EmulatedSelection | None = None

    @property
    def traffic(self):
        """Bytes sent by the sparse exchange so far (intra- and inter-node), for benchmarks."""
        return self.sparse.traffic

    def local_problem(self) -> str | None:
        """This rank's reason to stop the step (NaN/Inf in a gradient), shared through the step agreement."""
        # A NaN or Inf anywhere makes the sum non-finite: one pass instead of isfinite().all(), which
        # cost 0.5 s per step on VGG-19 here. Only then is the layer looked for (a sum that
        # overflowed from finite values finds none and passes). The sums add up on the gradients'
        # device: one value read back, one synchronisation with a GPU.
        flats = self.buffers.device_flats
        acc = emulated_accelerator()
        if acc is not None:  # the emulated gradients are fixed finite values: the device's pass, timed
            acc.issue("finite check", acc.model.pass_s(sum(f.numel() * f.element_size() for f in flats)))
            return None
        if not flats or math.isfinite(float(sum(f.sum().double() for f in flats))):
            return None
        for i, name in enumerate(self.ctx.names):
            if not bool(torch.isfinite(self.buffers.device_flat_views[i]).all()):
                return f"non-finite gradient (NaN or Inf) in {name}"
        return None

    problem_error = NonFiniteGradientError

    @classmethod
    def adopt_momentum(cls, optimizer, options) -> float:
        return take_sgd_momentum(optimizer) if options.momentum_correction else 0.0

    def finish(self, used, full: bool = False) -> None:
        step, self.steps = self.steps, self.steps + 1
        tl = self.timeline
        span = tl.begin(f"{self.name} step {step}", "sync", track="comm") if tl else None
        density = self.schedule(step)
        acc = emulated_accelerator()  # once per step: the real path pays one global read
        if acc is not None:
            if self._emulated is None:
                self._emulated = EmulatedSelection(acc)
        for b, flat in enumerate(self.buffers.device_flats):
            # What gets exchanged: the gradients, or under momentum correction this rank's velocity
            # (emulated: its two passes are in the selection's modelled time).
            local = flat if not self.momentum or acc is not None else \
                self._velocities()[b].mul_(self.momentum).add_(flat)
            # Staged, the host mirror of this buffer is free for MPI's dense work (on_device: nobody copies it).
            mirror = self.buffers.flats[b] if self.staged else None
            if self.schedule.dense(step):
                host = flat if mirror is None else mirror
                if local is not host:
                    host.copy_(local)
                self._copy(acc, "d2h", flat)
                self._handles = [self.dense.allreduce(host, tag=b)]
                wait_handles(self._handles, f"{self.name} dense warm-up allreduce", self.ctx)
                self._copy(acc, "h2d", flat)
                if host is not flat:
                    flat.copy_(host)
                flat.div_(self.size)
            elif self.granularity == "model":
                self._exchange(acc, ("model", b), local, flat, mirror, density)
                self._mask(self.velocity and self.velocity[b], density, acc)
                self._average(acc, flat)
            elif self.staged and acc is None:
                # Every layer of the buffer selected on the device, then one copy of all their pairs to the
                # host and one exchange: one wait for the device per buffer, not one per layer. The same
                # sums, residuals and masks as the loop below (SparseAllreduce's parts).
                self._exchange_layers(b, local, flat, mirror, density)
                self._mask(self.velocity and self.velocity[b], density)
                self._average(acc, flat)
            else:
                for i, (bi, a, z) in enumerate(self.buffers.segments):
                    if bi != b or a == z:
                        continue
                    g = flat[a:z]
                    self._exchange(acc, i, local[a:z], g, mirror[a:z] if mirror is not None else None, density)
                    self._mask(self.velocity and self.velocity[b][a:z], density, acc)
                    self._average(acc, g)
        self._handles = []
        if span is not None:
            tl.end(span)

    def _exchange(self, acc, key, local, out, mirror, density) -> None:
        """One sparse allreduce of `local` into `out`, selecting under `key` (emulated: see EmulatedSelection)."""
        if acc is None:
            self.sparse(local, lambda x: self.ef.select(key, x, density), out=out,
                        k_of=lambda n: k_for_density(n, density), host=mirror)
            return
        # The staged path's copies: hier-topk's node reduce-scatter takes the dense vector to the host and
        # its shard back; the pairs go to the host after the selection, every rank's come back to be summed.
        node_scatter = self.hierarchical and self.ctx.topology.local_size > 1
        if node_scatter:
            self._copy(acc, "d2h", local)
        acc.issue("memset", acc.model.memset_s(out.numel() * out.element_size()))  # the result's zeroing
        self.sparse(local, lambda x: self._emulated.select(key, x, density, from_host=node_scatter), out=out,
                    k_of=lambda n: k_for_density(n, density), host=mirror, gather_only=True)
        width = local.element_size()
        acc.issue("h2d", acc.model.copy_s(2 * self.sparse.pairs * width))
        # Each pair: its index and value read, its entry of the result read and written (a 32-byte sector each).
        acc.issue("sparse sum", acc.model.pass_s(self.sparse.pairs * (2 * width + 2 * 32)))

    def _exchange_layers(self, b, local, out, mirror, density) -> None:
        """Staged, per layer: one sparse allreduce of buffer b's layers, each selected under its own key."""
        layers = sorted((a, z, i) for i, (bi, a, z) in enumerate(self.buffers.segments) if bi == b and a != z)
        if not layers:  # only empty parameters: nothing to send
            return
        keys = [i for _, _, i in layers]
        self.sparse(local, lambda x, p: self.ef.select(keys[p], x, density), out=out,
                    k_of=lambda n: k_for_density(n, density), host=mirror, parts=[(a, z) for a, z, _ in layers])

    def _velocities(self) -> list:
        """The momentum correction's velocity per buffer, made (zero) by the first step that reads it. Under
        emulation none is read (its passes are in the selection's modelled time), so none is made: a model's worth
        of host memory a rank (VGG-19: 575 MB) that 8 ranks of one machine could not spare."""
        if self.velocity is None:
            self.velocity = [torch.zeros_like(f) for f in self.buffers.device_flats]
        return self.velocity

    def _average(self, acc, g) -> None:
        """The sum divided by the ranks: on the host, or under emulation the device's pass, timed."""
        if acc is None:
            g.div_(self.size)
        else:
            acc.issue("average", acc.model.pass_s(2 * g.numel() * g.element_size()))

    @staticmethod
    def _copy(acc, kind: str, t) -> None:
        if acc is not None:
            acc.issue(kind, acc.model.copy_s(t.numel() * t.element_size()))

    def _mask(self, velocity, density, acc=None) -> None:
        """DGC's momentum factor masking: forget the velocity of entries that were just applied.

        Masked where any rank's entry was applied (the indices of the sum),
        which is also what the hierarchical exchange can see; by index, not
        with a dense mask, which cost two passes over the model per step. At
        density 1 nothing was delayed and there is nothing stale to forget:
        not masked, so the strategy stays exactly momentum SGD there.
        """
        if velocity is not None and self.masking and density < 1.0 and acc is None:
            velocity.index_fill_(0, self.sparse.applied, 0)

    def state_dict(self) -> dict:
        local = {"residuals": self.ef.state_dict()}
        if self.velocity is not None:
            local["velocity"] = [v.detach().to("cpu", copy=True) for v in self.velocity]
        return {"shared": {"steps": self.steps}, "local": local}

    def load_state_dict(self, shared: dict, local: dict) -> None:
        self.steps = int(shared.get("steps", 0))
        self.ef.load_state_dict(local.get("residuals", {}))
        velocity = local.get("velocity")
        if self.momentum and velocity is not None:
            if [v.shape for v in velocity] != [v.shape for v in self._velocities()]:
                raise ValueError("the checkpoint's velocity does not match this model's gradient buffers")
            for mine, saved in zip(self.velocity, velocity):
                mine.copy_(saved)

    def abort(self) -> None:
        for h in self._handles:
            h.cancel()
        self._handles = []
        self.sparse.cancel()

    def close(self) -> None:
        self.sparse.free()
        self.dense.free()


class HierTopkSync(TopkSync):
    """MSTopK's hierarchical top-k allreduce: dense inside a node, sparse (k/L per rank) across nodes."""

    name = "hier-topk"
    hierarchical = True


def take_sgd_momentum(optimizer) -> float:
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
                         "no dampening); pass TopkOptions(momentum_correction=False) to keep the SGD's")
    for g in groups:
        g["momentum"] = 0.0
    return float(momenta.pop())
