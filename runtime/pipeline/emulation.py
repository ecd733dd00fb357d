"""Emulated pipeline compute: each stage's layers wait a modelled GPU's time (runtime.emulate), traced at its input."""

# A stage is emulated on its own, as the GPU holding it would run it: its
# example input is what reaches it (the micro-batch on the first stage, the
# previous stage's output activation elsewhere), found by tracing the layers
# one after another on the meta device (partition.layer_traces). Its outputs
# are tensors of the true shapes that hold no memory (every stride 0): the
# stage links copy what they send into contiguous buffers, so the true bytes
# cross every boundary.

from __future__ import annotations

import torch
from torch import nn

from .partition import layer_traces


def resolve(compute):
    """A runtime.emulate ComputeModel: given, or by its spec ('v100', 'h100:amp', 'PATH.json')."""
    from runtime.emulate import compute_model

    return compute_model(compute) if isinstance(compute, str) else compute


def label(compute) -> str:
    """The compute a pipeline runs on, as its ranks agree on it."""
    return "real" if compute is None else resolve(compute).label


def stage_input(layers: list[nn.Module], start: int, sample: torch.Tensor) -> torch.Tensor:
    """What the stage starting at layers[start] is called with, as a meta tensor: the sample, or layer start-1's output."""
    if start == 0:
        return torch.empty(sample.shape, dtype=sample.dtype, device="meta")
    out = layer_traces(layers[:start], sample)[-1].output
    return torch.empty(out.shape, dtype=out.dtype, device="meta")


def emulate_stage(world, stage: int, module: nn.Module, layers: list[nn.Module], start: int, sample: torch.Tensor,
                  compute, scale: float = 1.0):
    """The stage's module emulated in place (runtime.emulate.emulate), refusing inputs of other shapes; on every
    rank together (a rank whose process emulates another device already stops them all). Returns the
    accelerator, the loss to use (runtime.emulate.emulated_loss) and a wrapper for the optimizer factory."""
    from mpicomm.agree import fail_together
    from runtime.emulate import active, emulate, emulate_optimizer, emulated_loss

    from .checks import PipelineError

    problem = None
    try:
        example = stage_input(layers, start, sample)
        emulate(module, resolve(compute), (example,), scale=scale)
    except ValueError as exc:  # EmulationError, PartitionError: this rank's stage cannot be emulated as asked
        problem = f"stage {stage}: {exc}"
    fail_together(world, problem, PipelineError)
    expected, inner = (tuple(example.shape), example.dtype), module.forward

    def forward(x):
        # The emulated units answer with the traced shapes whatever they are given: another shape stops here.
        if (tuple(x.shape), x.dtype) != expected:
            raise ValueError(f"this stage's compute is emulated for inputs {describe(*expected)}, got "
                             f"{describe(tuple(x.shape), x.dtype)}: an emulated stage runs at the sample's "
                             "micro-batch shape only (no evaluation)")
        return inner(x)
    module.forward = forward

    def optimizer_factory(factory):
        def make(params):
            opt = factory(params)
            return emulate_optimizer(opt) if isinstance(opt, torch.optim.Optimizer) else opt
        return make
    return active(), emulated_loss, optimizer_factory


def describe(shape, dtype) -> str:
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"

