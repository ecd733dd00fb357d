"""A stage's optimizer: the user's, checked on every rank, and averaged across the stage's replicas."""

from __future__ import annotations

import torch

from mpicomm.agree import fail_together

from .checks import PipelineError
from .versions import momentum_sgd_hyper

__all__ = ["stage_optimizer"]


def stage_optimizer(world, stage: int, params, factory, mode: str, module, layout, microbatches: int,
                    data_parallel, policy):
    """(optimizer, DistributedOptimizer over the replica group or None). Collective over `world`: a factory
    that fails or returns something else on any rank stops every rank with a PipelineError."""
    problem, optimizer, dopt = None, None, None
    try:
        optimizer = factory(params) if params else None
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer_factory must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if mode == "spectrain" and optimizer is not None:
            momentum_sgd_hyper(optimizer)
    except (ValueError, TypeError) as exc:
        problem = f"stage {stage}: {exc}"
    fail_together(world, problem, PipelineError)
    if optimizer is None:  # a stage of parameter-free layers: nothing to update
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    if layout.replicas > 1 and params:
        from runtime.optimizer import DistributedOptimizer

        # Gradient accumulation over the step's micro-batches in flush mode: one average per step.
        dopt = DistributedOptimizer(optimizer, module, data_parallel, comm=layout.replica_group, stall=policy,
                                    backward_passes_per_step=microbatches if mode == "flush" else 1)
    return optimizer, dopt
