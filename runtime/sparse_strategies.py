"""Top-k sparsified gradient exchange with error feedback: flat (`topk`) and hierarchical (`hier-topk`)."""

from __future__ import annotations

import math

import torch

from mpicomm import Ring
from mpicomm.agree import check_same_structure, fail_together
from mpicomm.sparse_allreduce import SparseAllreduce

from .error_feedback import DensitySchedule, ErrorFeedback
from .mstopk import MSTopK, exact_topk
from .strategies import Strategy, _pack, _unpack

OPERATORS = ("mstopk", "exact")
GRANULARITIES = ("model", "layer")


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf; raised on every rank, naming the rank and the layer."""


class TopkSync(Strategy):
    """Each step sends only the largest `density` fraction of the (error-compensated) gradient.

    Not exact SGD: the unsent remainder waits in a per-rank residual (error
    feedback) and joins later steps. `warmup_steps` dense steps and a DGC-style
    ramp of `ramp_steps` ease the start. Selection runs over the flattened
    model (`granularity="model"`, one exchange per step) or per parameter
    (`"layer"`, k per layer). Every step first checks collectively that no
    gradient holds NaN/Inf, so a bad layer is named instead of spreading.

    momentum > 0 is DGC's momentum correction (the optimizer wrapper moves an
    SGD's momentum here and runs the SGD without it): each rank keeps its
    velocity u = m*u + g and u, not g, is what gets sparsified, so what waits
    in the residual is not amplified again by the optimizer's momentum; with
    `momentum_masking` u is then cleared where entries were applied. By
    linearity, at density 1 or in dense warm-up steps this is exactly
    momentum SGD.
    """

    name = "topk"
    hierarchical = False

    def __init__(self, comm, params, timeline=None, *, topology, density: float = 0.01,
                 error_feedback: bool = True, warmup_steps: int = 0, ramp_steps: int = 0,
                 granularity: str = "model", operator: str = "mstopk", names: list[str] | None = None,
                 momentum: float = 0.0, momentum_masking: bool = True):
        super().__init__(comm, params, timeline)
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        if operator not in OPERATORS:
            raise ValueError(f"operator must be one of {OPERATORS}, got {operator!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.schedule = DensitySchedule(density, warmup_steps, ramp_steps)
        # Ranks selecting different k would meet in the exchange with different sizes: refuse up front.
        check_same_structure(comm, [f"{self.name} {self.schedule.describe()} error_feedback={error_feedback} "
                                    f"granularity={granularity} operator={operator} momentum={momentum} "
                                    f"masking={momentum_masking}"],
                             "sparsification setting")
        self.granularity = granularity
        self.names = names or [f"parameter #{i}" for i in range(len(params))]
        topk = MSTopK() if operator == "mstopk" else exact_topk
        self.ef = ErrorFeedback(topk, enabled=error_feedback)
        self.sparse = SparseAllreduce(topology, hierarchical=self.hierarchical)
        self.dense = Ring(comm)
        dtype = params[0].dtype if params else torch.float32
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype)
        self.momentum, self.masking = momentum, momentum_masking
        self.velocity = torch.zeros_like(self.flat) if momentum else None
        self.grads: list = [None] * len(params)
        self.steps = 0

    @property
    def traffic(self):
        """Bytes sent by the sparse exchange so far (intra- and inter-node), for benchmarks."""
        return self.sparse.traffic

    def grad_ready(self, i, grad):
        self.grads[i] = grad

    def finish(self):
        step, self.steps = self.steps, self.steps + 1
        tl = self.timeline
        span = tl.begin(f"{self.name} step {step}", "sync", track="comm") if tl else None
        views = _pack(self.grads, self.flat)
        self._check_finite()
        # What gets exchanged: the gradients, or under momentum correction this rank's velocity.
        local = self.flat if self.velocity is None else self.velocity.mul_(self.momentum).add_(self.flat)
        if self.schedule.dense(step):
            if local is not self.flat:
                self.flat.copy_(local)
            self.dense.allreduce(self.flat).wait()
            _unpack(self.flat.div_(self.size), views)
        elif self.granularity == "model":
            density = self.schedule(step)
            summed = self.sparse(local, lambda x: self.ef.select("model", x, density))
            self._mask(self.velocity, density)
            _unpack(summed.div_(self.size), views)
        else:
            density = self.schedule(step)
            for i, (g, off) in enumerate(views):
                summed = self.sparse(local[off:off + g.numel()], lambda x, i=i: self.ef.select(i, x, density))
                self._mask(None if self.velocity is None else self.velocity[off:off + g.numel()], density)
                g.copy_(summed.div_(self.size).view_as(g))
        if span is not None:
            tl.end(span)

    def _mask(self, velocity, density) -> None:
        """DGC's momentum factor masking: forget the velocity of entries that were just applied.

        Masked where any rank's entry was applied (the indices of the sum),
        which is also what the hierarchical exchange can see; by index, not
        with a dense mask, which cost two passes over the model per step. At
        density 1 nothing was delayed and there is nothing stale to forget:
        not masked, so the strategy stays exactly momentum SGD there.
        """
        if velocity is not None and self.masking and density < 1.0:
            velocity.index_fill_(0, self.sparse.applied, 0)

    def _check_finite(self) -> None:
        """Collective: stop every rank if any rank's gradients hold NaN/Inf (checked on the packed flat copy)."""
        problem = None
        # A NaN or Inf anywhere makes the sum non-finite; one pass instead of isfinite().all(),
        # which cost 0.5 s per step on VGG-19 here. Only then is the layer looked for (a sum
        # that overflowed from finite values finds none and passes).
        if not math.isfinite(float(self.flat.sum())):
            for i, g in enumerate(self.grads):
                if not bool(torch.isfinite(g).all()):
                    problem = f"non-finite gradient (NaN or Inf) in {self.names[i]}"
                    break
        fail_together(self.comm, problem, NonFiniteGradientError)

    def close(self):
        self.sparse.free()
        self.dense.free()


class HierTopkSync(TopkSync):
    """MSTopK's hierarchical top-k allreduce: dense inside a node, sparse (k/L per rank) across nodes."""

    name = "hier-topk"
    hierarchical = True


SPARSE_STRATEGIES = {"topk": TopkSync, "hier-topk": HierTopkSync}
