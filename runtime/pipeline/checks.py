"""What a Pipeline must be given: its arguments checked on every rank together, the same layers and weights."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI
from torch import nn

from mpicomm.agree import fail_together
from runtime.device import staging_wanted

from . import partition
from .placement import PLACEMENTS
from .staging import stage_device
from .versions import MODES, SPECTRAIN_VARIANTS

DATA_PARALLEL = ("allreduce", "wfbp")


class PipelineError(RuntimeError):
    """A pipeline that cannot be built or run as asked; raised on every rank."""


def check_arguments(world, model, stages, balance, microbatches, mode, variant, replicas, placement,
                     data_parallel, sample, device, staging, local_rank, diverge_factor=None, compute=None,
                     compute_scale=1.0):
    """Local checks, then agreement: a rank with a bad argument stops every rank, each naming it."""
    problem, layers, where, staged = None, [], None, False
    try:
        layers = partition.as_layers(model)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if variant not in SPECTRAIN_VARIANTS:
            raise ValueError(f"spectrain_variant must be one of {SPECTRAIN_VARIANTS}, got {variant!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}")
        for name, value in (("microbatches", microbatches), ("replicas", replicas)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if diverge_factor is not None and not (isinstance(diverge_factor, (int, float)) and diverge_factor > 1):
            raise ValueError(f"diverge_factor must be a number > 1, or None, got {diverge_factor!r}")
        if (stages is None) == (balance is None):
            raise ValueError("give stages=N (automatic partition) or balance=[layers per stage], not both")
        if balance is not None:
            partition.check_stages(len(partition.check_balance(balance, len(layers))), len(layers))
        else:
            partition.check_stages(stages, len(layers))
            if sample is None:
                raise ValueError("the automatic partition times each layer on a sample micro-batch: pass "
                                 "sample=<inputs of one micro-batch>, or balance=[layers per stage]")
        if compute is not None:
            from runtime.emulate import compute_model

            if isinstance(compute, str):
                compute_model(compute)  # an unknown device or a bad profile: EmulationError, a ValueError
            if sample is None:
                raise ValueError("emulated compute traces each stage at the shape of its input: pass sample=<inputs "
                                 "of one micro-batch> on every rank")
            if not (isinstance(compute_scale, (int, float)) and compute_scale > 0):
                raise ValueError(f"compute_scale must be a number > 0, got {compute_scale!r}")
        where = stage_device(device, local_rank)
        if compute is not None and where.type != "cpu":
            raise ValueError(f"emulated compute runs on the host: leave device at cpu, not {where}")
        staged = bool(staging) or staging_wanted(where)  # a GPU stage always is; MPITRAIN_STAGING=force
    except (ValueError, TypeError) as exc:
        problem = str(exc)
    fail_together(world, problem, PipelineError)
    return layers, where, staged


def split_batch(batch, what: str, stage: int, microbatches: int, device) -> list:
    """A stage's batch cut into `microbatches` equal micro-batches on the stage's device."""
    import torch

    if isinstance(batch, (tuple, list)) and len(batch) == 1:
        batch = batch[0]
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"{what} must be a tensor on stage {stage}, got {type(batch).__name__}")
    if batch.shape[0] % microbatches:
        raise ValueError(f"{what}: a batch of {batch.shape[0]} does not split into {microbatches} "
                         "equal micro-batches")
    # One copy a step (none on the CPU); asynchronous only from pinned memory, where it can be: from pageable
    # memory CUDA copies synchronously whatever is asked, and asking would only say otherwise.
    batch = batch.to(device, non_blocking=batch.device.type == "cpu" and batch.is_pinned())
    return list(batch.split(batch.shape[0] // microbatches))


def describe_layers(layers: list[nn.Module]) -> list[str]:
    return [f"{i}:{type(m).__name__} {n} {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
            for i, m in enumerate(layers) for n, p in m.named_parameters()] or ["(no parameters)"]


def check_same_values(comm: MPI.Comm, layers: list[nn.Module]) -> None:
    """Every rank built the same initial weights (same seed): one float64 sum per parameter, compared."""
    params = [(f"{i}:{n}", p) for i, m in enumerate(layers) for n, p in m.named_parameters()]
    if not params:
        return
    mine = np.array([float(p.detach().double().sum()) for _, p in params])
    everyone = np.empty((comm.Get_size(), len(params)))
    comm.Allgather(mine, everyone)
    same = np.isclose(everyone, everyone[0], rtol=1e-12, atol=0.0).all(axis=0)
    if not same.all():
        j = int(np.argmin(same))
        raise PipelineError(f"ranks built different initial weights (layer parameter {params[j][0]}: "
                            + ", ".join(f"rank {r}: sum {everyone[r, j]:.6g}" for r in range(comm.Get_size()))
                            + "); build the model with the same seed on every rank")
