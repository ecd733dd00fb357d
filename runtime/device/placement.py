"""Which device a rank's model sits on (errors for models on several), whether it is staged, and how that reads."""

from __future__ import annotations

import functools
import os

import torch

from mpicomm.cuda_support import describe_cuda_support

from ..emulate.accelerator import active as emulated_accelerator
from ..emulate.watch import ready_aware
from .emulated_staging import EmulatedStaging
from .staging import GradientStaging

STAGING_ENV = "MPITRAIN_STAGING"  # "force": a CPU model goes through the staged path too (tests without a GPU)
SUPPORTED = ("cpu", "cuda")


def model_device(names: list[str], params: list[torch.Tensor]) -> torch.device:
    """The one device every trainable parameter is on; a clear error naming the first one that is not.

    A model split across CPU and GPU, or across two GPUs within one rank,
    would need a transfer per boundary that data parallelism does not make:
    the pipeline engine (runtime.pipeline) is the way to split a model.
    """
    if not params:
        return torch.device("cpu")
    first = params[0].device
    for name, p in zip(names, params):
        if p.device.type not in SUPPORTED:
            raise ValueError(f"parameter {name} is on {p.device}: DistributedOptimizer trains models on "
                             f"{' or '.join(SUPPORTED)} (move the model there with model.to(device))")
        if p.device != first:
            raise ValueError(f"parameter {name} is on {p.device} but {names[0]} is on {first}: the model must sit "
                             "on one device per rank (model.to(device)); to split a model across devices use "
                             "the pipeline engine (runtime.pipeline)")
    if first.type == "cuda" and not torch.cuda.is_available():  # pragma: no cover - a tensor on CUDA implies it
        raise RuntimeError(f"parameter {names[0]} is on {first} but torch reports no CUDA device")
    return first


def staging_wanted(device: torch.device) -> bool:
    """GPU gradients always go through host staging; MPITRAIN_STAGING=force stages a CPU model as well."""
    value = os.environ.get(STAGING_ENV, "").strip().lower()
    if value not in ("", "auto", "force"):
        raise ValueError(f"{STAGING_ENV} must be 'auto' or 'force', got {value!r}")
    return device.type != "cpu" or value == "force"


def gradient_staging(buffers, deliver, interrupt, timeline, on_device: bool, groups=None):
    """What moves the wrapper's gradients to the host for MPI and back: GradientStaging for a staged model
    (in `groups`, the strategy's buckets, or its own), EmulatedStaging (the copies' modelled time) under
    emulated compute (runtime.emulate), else nothing."""
    if on_device:  # the strategy moves (index, value) pairs itself
        return None
    if buffers.staged:
        return GradientStaging(buffers, deliver, interrupt, timeline, groups)
    acc = emulated_accelerator()
    return EmulatedStaging(acc, buffers, deliver, interrupt, timeline) if acc is not None else None


def gradient_hook(on_grad, staging):
    """The parameter hook to register: on_grad, marked ready_aware under EmulatedStaging, whose thread waits for
    each gradient's modelled ready time, so that an emulated backward watched by nothing else may fire it ahead
    of the device, as a GPU's host runs ahead of its backward (runtime.emulate.watch)."""
    if isinstance(staging, EmulatedStaging):
        return ready_aware(functools.partial(on_grad))
    return on_grad


def describe_transport(device, staged: bool, on_device: bool, drives: bool = False) -> str:
    """How gradients reach MPI, for job headers and timelines (drives: a progress thread drives MPI while
    training waits, mpicomm.progress.ProgressThread's drive)."""
    if drives:
        return describe_transport(device, staged, on_device) + "; its progress thread drives MPI while training waits"
    if device.type == "cpu" and not staged:
        return "host memory"
    where = "through pinned host memory on a side stream" if device.type == "cuda" else "through a host mirror"
    if on_device:
        return f"selection on {device.type}, (index, value) pairs {where} (MPI {describe_cuda_support()})"
    return f"staged {where} (MPI {describe_cuda_support()})"
