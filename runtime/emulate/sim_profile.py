"""A compute model as the simulator's Profile: the modelled seconds per layer that emulate() waits, exactly."""

from __future__ import annotations

from torch import nn

from .compute_model import ComputeModel, compute_model
from .trace import EmulationError, trace

__all__ = ["modelled_profile"]

GEMM_SIDE = 4096  # the GEMM whose modelled time gives the profile's rate (hybcomm's rebuild of the factors)


def modelled_profile(model: nn.Module, compute: ComputeModel | str, inputs: tuple, name: str,
                     optimizer_state: int = 1, scale: float = 1.0, every_unit: bool = False):
    """runtime.sim's Profile of `model` called with `inputs` under `compute` (a device name, a profile's path, or
    a ComputeModel) times `scale`, laid out as runtime.sim.measure lays out a measured one: a layer per unit
    owning parameters, in forward order; its forward from its start to the next such unit's (the units without
    parameters between are in it), its backward from the next one's last gradient to its own. Units before the
    first such unit go to its forward, and their backward, after the last gradient, to the rest (other_s), with
    zero_grad's memset. The optimizer step is the model's for SGD with momentum (optimizer_state 1) or Adam (2).

    So the simulator and emulate() time the same work from the same trace: what the two then disagree on is the
    communication and the host, which is what a validation of the simulator against emulation should see.

    every_unit: a layer per unit, parameters or not (a pipeline's stage may hold only a ReLU or a pooling, and a
    cut after a Linear leaves its ReLU to the next stage; jobs.sim.modelled.unit_split maps a run's balance).
    """
    from runtime.sim.measure import buffer_counts
    from runtime.sim.profile import Layer, Profile

    if not scale > 0:
        raise EmulationError(f"compute scale must be positive, got {scale!r}")
    cm = compute_model(compute) if isinstance(compute, str) else compute
    tr = trace(model, tuple(inputs))
    times = cm.unit_times(tr)
    owners = [i for i, c in enumerate(tr.calls) if every_unit or any(p.requires_grad for p in c.params)]
    if not owners:
        raise EmulationError(f"{type(model).__name__} has no unit with parameters that take gradients")
    before_f = sum(f for f, _ in times[:owners[0]])
    before_b = sum(b for _, b in times[:owners[0]])
    layers = []
    for k, i in enumerate(owners):
        end = owners[k + 1] if k + 1 < len(owners) else len(tr.calls)
        span = times[i:end]
        call = tr.calls[i]
        params = [p for p in call.params + (tr.loose if k == 0 else ()) if p.requires_grad]
        # What a pipeline cut after this layer hands on: the next layer's input; the last one's output.
        handoff = tr.calls[end].inputs[0] if end < len(tr.calls) and tr.calls[end].inputs else tr.calls[end - 1].output
        layers.append(Layer(call.name or type(call.module).__name__,
                            (sum(f for f, _ in span) + (before_f if k == 0 else 0.0)) * scale,
                            sum(b for _, b in span) * scale, tuple(p.numel() for p in params), handoff.nbytes,
                            _linear(call)))
    params = [p for p in model.parameters() if p.requires_grad]
    elements = sum(p.numel() for p in params)
    itemsize = params[0].element_size()
    optimizer_s = cm.optimizer_s(elements, len(params), optimizer_state) * scale
    other_s = (before_b + cm.memset_s(itemsize * elements)) * scale
    layer_s = sum(l.fwd_s + l.bwd_s for l in layers)
    gemm = cm.gemm_s(GEMM_SIDE, GEMM_SIDE, GEMM_SIDE) * scale
    # The model's host <-> device rate, from two sizes (its per-copy latency cancels); 0: no copies (a CPU's profile).
    copy_span = cm.copy_s(2 ** 30) - cm.copy_s(2 ** 20)
    copy = (2 ** 30 - 2 ** 20) / copy_span / 1e9 / scale if copy_span > 0 else 0.0  # emulated copies scale too
    pass_span = cm.pass_s(2 ** 30) - cm.pass_s(2 ** 20)  # the device memory's rate, as accumulating micro-batches
    memory = (2 ** 30 - 2 ** 20) / pass_span / 1e9 / scale if pass_span > 0 else 0.0
    return Profile(name, _batch(tr), "cuda", tuple(layers), layer_s + optimizer_s + other_s, optimizer_s, other_s,
                   ranks_at_once=1, cores=1.0, cores_per_rank=1.0, threads=1,
                   select_s_per_element=cm.select_s(elements) * scale / elements,
                   gflops=2.0 * GEMM_SIDE ** 3 / gemm / 1e9 if gemm > 0 else 100.0, copy_gbs=float(copy),
                   itemsize=itemsize, memory_gbs=memory, **buffer_counts(model),
                   machine=f"modelled: {cm.label}" + (f", compute x{scale:g}" if scale != 1 else ""),
                   extra={"compute_model": cm.label, "compute_scale": scale})


def _linear(call):
    m = call.module
    if not isinstance(m, nn.Linear):
        return None
    return (m.in_features, m.out_features, call.output.numel // m.out_features, m.bias is not None)


def _batch(tr) -> int:
    first = tr.calls[0].inputs[0] if tr.calls[0].inputs else tr.calls[0].output
    return int(first.shape[0]) if first.shape else 1
