"""The trained model out of a pipeline: each stage's state (checkpoints), or the whole model's assembled on one rank."""

from __future__ import annotations

import torch
from torch import nn

from mpicomm.agree import fail_together

from .checks import PipelineError


def stage_state(pipe) -> dict:
    """This stage's weights and optimizer state, with where they belong (stage, stages, balance, layers)."""
    return dict(stage=pipe.stage, stages=pipe.stages, balance=pipe.balance, mode=pipe.mode,
                layers=[pipe.layer_range.start, pipe.layer_range.stop], module=pipe.module.state_dict(),
                optimizer=pipe.optimizer.state_dict())


def load_stage_state(pipe, state: dict) -> None:
    if (state.get("stage"), state.get("stages"), state.get("balance")) != (pipe.stage, pipe.stages, pipe.balance):
        raise ValueError(f"state of stage {state.get('stage')} of {state.get('stages')} (balance "
                         f"{state.get('balance')}) does not fit stage {pipe.stage} of {pipe.stages} "
                         f"(balance {pipe.balance})")
    pipe.module.load_state_dict(state["module"])
    pipe.optimizer.load_state_dict(state["optimizer"])


def load_stages(model, states: list[dict]) -> None:
    """Every stage's state (stage_state(), e.g. from the stage checkpoints) into one model, built as for the pipeline.

    model: what was given to Pipeline (nn.Sequential, list of modules, or a model with pipeline_layers()).
    """
    from .partition import as_layers

    layers = as_layers(model)
    if sorted(s["stage"] for s in states) != list(range(states[0]["stages"])):
        raise ValueError(f"need one state per stage 0..{states[0]['stages'] - 1}, got stages "
                         f"{sorted(s['stage'] for s in states)}")
    for s in states:
        a, b = s["layers"]
        nn.Sequential(*layers[a:b]).load_state_dict(s["module"])


def gather_state_dict(pipe, root: int) -> dict | None:
    """The whole model's state_dict on world rank `root` (None elsewhere), from each stage's first replica.

    Collective over the pipeline's world, after an agreement round (every rank
    must call it at the same point). On `root` the model given to Pipeline
    also holds the trained weights afterwards (its layers are loaded in place);
    the returned tensors are CPU copies, keyed as that model's state_dict()
    (a list of modules: "layer index.name").
    """
    world = pipe.topology.world
    problem, mine = None, None
    try:
        if not isinstance(root, int) or not 0 <= root < world.Get_size():
            raise ValueError(f"root must be a rank of the pipeline's {world.Get_size()} ranks, got {root!r}")
        if pipe.replica == 0:  # replicas hold the same weights: the first one's are sent
            mine = {k: v.detach().to("cpu", copy=True) for k, v in pipe.module.state_dict().items()}
    except ValueError as exc:
        problem = str(exc)
    fail_together(world, problem, PipelineError)
    parts = world.gather(None if mine is None else (pipe.stage, mine), root=root)
    if world.Get_rank() != root:
        return None
    try:
        for stage, state in (p for p in parts if p is not None):
            a = sum(pipe.balance[:stage])
            with torch.no_grad():
                nn.Sequential(*pipe.layers[a:a + pipe.balance[stage]]).load_state_dict(state)
        whole = pipe.model if isinstance(pipe.model, nn.Module) else nn.Sequential(*pipe.layers)
        out = {k: v.detach().to("cpu", copy=True) for k, v in whole.state_dict().items()}
    except (RuntimeError, ValueError) as exc:  # the caller's model changed shape since: say so on root
        raise PipelineError(f"gather_state_dict: the stages' weights do not load into the model: {exc}") from exc
    return out
