"""Cutting a sequential model into stages: by explicit balance, or by measured layer times (PipeDream's partitioner)."""

# The automatic plan times each layer's forward + backward on a sample
# micro-batch and notes its output size, then chooses the contiguous split
# into N stages that minimises the slowest stage, a stage costing its layers'
# compute plus sending its output activation forward and receiving its
# gradient back at the link bandwidth (PipeDream, Narayanan et al. 2019,
# section 3.1, without replication). Dynamic programming over (layers, stages):
# O(N L^2) for L layers.

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn


class PartitionError(ValueError):
    """The model or the balance cannot be cut into the stages asked for."""


def as_layers(model) -> list[nn.Module]:
    """The chain of layers of an nn.Sequential (nested ones flattened), a list of modules, or `model.pipeline_layers()`.

    A model (not a list) also names its modules as its profile does (runtime.emulate.name_modules): a stage
    emulated from a profile of the whole model finds its layers' times in it."""
    if isinstance(model, nn.Module):
        from runtime.emulate.compute_model import name_modules

        name_modules(model)
    return _chain(model)


def _chain(model) -> list[nn.Module]:
    if hasattr(model, "pipeline_layers") and not isinstance(model, nn.Sequential):
        model = model.pipeline_layers()
    if isinstance(model, nn.Sequential):
        out: list[nn.Module] = []
        for child in model:
            out += _chain(child) if isinstance(child, nn.Sequential) else [child]
        return out
    if isinstance(model, (list, tuple)):
        for i, layer in enumerate(model):
            if not isinstance(layer, nn.Module):
                raise PartitionError(f"layer {i} is a {type(layer).__name__}, not an nn.Module")
        return [c for layer in model for c in (_chain(layer) if isinstance(layer, nn.Sequential) else [layer])]
    if isinstance(model, nn.Module):
        raise PartitionError(f"{type(model).__name__} is not sequential: its forward() is not a chain of layers "
                             "the pipeline can cut. Pass an nn.Sequential, a list of modules, or give the class a "
                             "pipeline_layers() method returning the chain")
    raise PartitionError(f"a pipeline takes an nn.Sequential or a list of modules, not a {type(model).__name__}")


def check_balance(balance, layers: int) -> list[int]:
    """An explicit balance: positive layer counts per stage, summing to the model's layers."""
    if not isinstance(balance, (list, tuple)) or not balance or \
            any(not isinstance(b, int) or isinstance(b, bool) for b in balance):
        raise PartitionError(f"balance must be a list of layer counts per stage, got {balance!r}")
    if any(b < 1 for b in balance):
        raise PartitionError(f"every stage needs at least one layer, balance {list(balance)} has an empty stage")
    if sum(balance) != layers:
        raise PartitionError(f"balance {list(balance)} covers {sum(balance)} layers, the model has {layers}")
    return list(balance)


def check_stages(stages, layers: int) -> int:
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise PartitionError(f"stages must be an integer >= 1, got {stages!r}")
    if stages > layers:
        raise PartitionError(f"{stages} stages need at least {stages} layers; the model has {layers}")
    return stages


@dataclass
class LayerProfile:
    name: str
    seconds: float  # forward + backward of one micro-batch
    out_bytes: int  # its output activation (the gradient back is as large)
    param_bytes: int
    params: int


def profile_layers(layers: list[nn.Module], sample: torch.Tensor, repeats: int = 3,
                   device=None) -> list[LayerProfile]:
    """Median forward+backward time of each layer on `sample` (one micro-batch), with its output and parameter sizes.

    device: where to time them (default: the sample's). On a GPU each layer is timed on a copy
    there (the caller's layers stay where they are), with the device synchronised around the timed
    region: kernels run asynchronously, so the host's clock alone would time their launch.
    """
    device = torch.device(device) if device is not None else sample.device
    cuda = device.type == "cuda"
    out = []
    x = sample.to(device)
    for i, original in enumerate(layers):
        layer = copy.deepcopy(original).to(device) if cuda else original
        times = []
        for _ in range(repeats + 1):  # the first run warms up allocators and kernels
            inp = x.detach().requires_grad_(x.is_floating_point())
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            y = layer(inp)
            if not isinstance(y, torch.Tensor):
                raise PartitionError(f"layer {i} ({type(layer).__name__}) returns a {type(y).__name__}; "
                                     "pipeline boundaries carry one tensor")
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        params = sum(p.numel() for p in layer.parameters())
        out.append(LayerProfile(f"{i}:{type(layer).__name__}", statistics.median(times[1:]),
                                y.numel() * y.element_size(),
                                sum(p.numel() * p.element_size() for p in layer.parameters()), params))
        x = y.detach()
        del layer  # a GPU copy: freed before the next layer's
    return out


def layer_traces(layers: list[nn.Module], sample: torch.Tensor) -> list:
    """Each layer's trace (runtime.emulate.trace: its units, its output) on the meta device, fed the previous
    layer's output: the shapes every stage sees, at no cost."""
    from runtime.emulate.trace import trace

    x, out = torch.empty(sample.shape, dtype=sample.dtype, device="meta"), []
    for i, layer in enumerate(layers):
        try:
            t = trace(nn.Sequential(layer), (x,))  # wrapped: a leaf layer is then a unit of its own
        except ValueError as exc:
            raise PartitionError(f"layer {i} ({type(layer).__name__}): {exc}") from None
        out.append(t)
        x = torch.empty(t.output.shape, dtype=t.output.dtype, device="meta")
    return out


def modelled_profile(layers: list[nn.Module], sample: torch.Tensor, compute, scale: float = 1.0) -> list[LayerProfile]:
    """profile_layers under emulated compute: each layer's modelled forward + backward time on `compute`
    (a runtime.emulate ComputeModel or its spec, 'v100'), times `scale`; nothing runs."""
    from runtime.emulate import compute_model

    model = compute_model(compute) if isinstance(compute, str) else compute
    out = []
    for i, (layer, t) in enumerate(zip(layers, layer_traces(layers, sample))):
        params = list(layer.parameters())
        out.append(LayerProfile(f"{i}:{type(layer).__name__}", sum(f + b for f, b in model.unit_times(t)) * scale,
                                t.output.nbytes, sum(p.numel() * p.element_size() for p in params),
                                sum(p.numel() for p in params)))
    return out


def best_balance(profile: list[LayerProfile], stages: int, bandwidth_bps: float | None = None) -> list[int]:
    """The split minimising the slowest stage (compute + its boundary's transfer time); ties: earlier cuts."""
    L = check_stages(stages, len(profile))  # stages
    n = len(profile)  # layers
    prefix = [0.0]
    for p in profile:
        prefix.append(prefix[-1] + p.seconds)

    def cost(a: int, b: int) -> float:  # layers a..b-1 as one stage
        t = prefix[b] - prefix[a]
        if bandwidth_bps and b < n:  # activation out and its gradient back, one each way per micro-batch
            t += 8 * profile[b - 1].out_bytes / bandwidth_bps
        return t

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(L + 1)]  # best[s][b]: first b layers in s stages
    cut = [[0] * (n + 1) for _ in range(L + 1)]
    best[0][0] = 0.0
    for s in range(1, L + 1):
        for b in range(s, n + 1):
            for a in range(s - 1, b):
                c = max(best[s - 1][a], cost(a, b))
                if c < best[s][b] - 1e-12:
                    best[s][b], cut[s][b] = c, a
    balance, b = [], n
    for s in range(L, 0, -1):
        a = cut[s][b]
        balance.append(b - a)
        b = a
    return balance[::-1]


def plan_table(profile: list[LayerProfile], balance: list[int], bandwidth_bps: float | None = None) -> str:
    """The plan as a table: per stage its layers, parameters and predicted time per micro-batch."""
    rows = ["| stage | layers | parameters | MB | compute ms | boundary KB | transfer ms |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    a = 0
    for k, count in enumerate(balance):
        part = profile[a:a + count]
        out = part[-1].out_bytes if a + count < len(profile) else 0
        transfer = 8 * out / bandwidth_bps * 1e3 if bandwidth_bps and out else 0.0
        names = part[0].name if count == 1 else f"{part[0].name} .. {part[-1].name}"
        rows.append(f"| {k} | {names} | {sum(p.params for p in part):,} | "
                    f"{sum(p.param_bytes for p in part) / 1e6:.1f} | {sum(p.seconds for p in part) * 1e3:.2f} | "
                    f"{out / 1e3:.1f} | {transfer:.2f} |")
        a += count
    return "\n".join(rows)


def decide(world, layers, balance, stages: int, sample, bandwidth, device, error=PartitionError, compute=None,
           scale: float = 1.0):
    """(balance, the plan's table): rank 0 times the layers and decides for every rank; the table on rank 0 only.

    compute: under emulated compute (a ComputeModel or its spec), the layers' modelled times instead.
    """
    import numpy as np

    from mpicomm.agree import fail_together

    plan = np.zeros(stages, dtype=np.int64)
    table, problem = "", None
    if world.Get_rank() == 0:
        try:
            if sample is None:
                profile = None
            elif compute is not None:
                profile = modelled_profile(layers, sample, compute, scale)
            else:
                profile = profile_layers(layers, sample, device=device)
            chosen = balance if balance is not None else best_balance(profile, stages, bandwidth)
            plan[:] = chosen
            table = plan_table(profile, list(chosen), bandwidth) if profile else \
                f"balance {list(chosen)} (no sample given: layer times not measured)"
        except Exception as exc:  # the user's layers failing on the sample
            problem = f"partition: {type(exc).__name__}: {exc}"
    fail_together(world, problem, error)
    world.Bcast(plan, root=0)
    return [int(b) for b in plan], table
