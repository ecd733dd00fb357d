"""emulate(): a model whose units wait their modelled time instead of computing, with outputs and gradients of the
true shapes; emulated_loss() and emulate_optimizer() for the rest of a step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .accelerator import Accelerator, activate, active
from .compute_model import ComputeModel, compute_model
from .landing import defer_zero, land, landed
from .trace import Call, EmulationError, TensorSpec, trace

__all__ = ["emulate", "emulated_loss", "emulate_optimizer", "optimizer_state", "Emulation"]


@dataclass
class _Step:
    call: Call
    fwd_s: float
    bwd_s: float
    arg: int | None  # which model input the unit takes as it is (the data, the tokens), else None
    params: tuple
    ahead: tuple = ()  # the last unit's: every parameter of the model, landed as the backward pass starts


class Emulation:
    """What emulate() installed on a model: its steps, and the accelerator they run on."""

    def __init__(self, model: nn.Module, steps: list[_Step], output: TensorSpec, acc: Accelerator):
        self.model, self.steps, self.output, self.acc = model, steps, output, acc
        self.cursor: tuple | None = None
        self._zeros: dict[torch.dtype, torch.Tensor] = {}
        self.forward_s = sum(s.fwd_s for s in steps)
        self.backward_s = sum(s.bwd_s for s in steps)

    def zeros(self, spec_or_shape, dtype=None) -> torch.Tensor:
        """A tensor of this shape that holds no memory: one zero, every stride 0 (a fresh view each call)."""
        shape, dtype = (spec_or_shape.shape, spec_or_shape.dtype) if dtype is None else (spec_or_shape, dtype)
        base = self._zeros.get(dtype)
        if base is None:
            base = self._zeros[dtype] = torch.zeros((), dtype=dtype)
        return base.expand(shape)

    def forward(self, *inputs):
        self.acc.clock.begin()
        link = None
        for step in self.steps:
            spec = step.call.inputs[0] if step.call.inputs else step.call.output
            arg = inputs[step.arg] if step.arg is not None else self.zeros(spec)
            self.cursor = (step, link)
            link = step.call.module(arg)
        self.cursor = None
        self.acc.clock.sync()  # the layers ran lazily (Clock.run): the pass ends when its last one does
        if tuple(link.shape) != self.output.shape:
            link = _Reshape.apply(link, self.output.shape)
        return link

    def unit_forward(self, *args, **kwargs):
        step, link = self.cursor
        x = link if link is not None else args[0]
        if len(step.params) <= _DIRECT:
            # The unit's own node takes its parameters: the engine accumulates a node's one or two parameter
            # gradients in the order of its inputs, as it does a real layer's (weight, then bias).
            return _Unit.apply(self, step, x, *reversed(step.params))
        out = _Unit.apply(self, step, x)
        # More: one node per parameter, chained: backward reaches them last-attached first, so each gradient
        # is accumulated (and its hooks fire) in the real model's order, after the unit's backward time.
        for k, p in enumerate(step.params):
            out = _Attach.apply(self, step if k == len(step.params) - 1 else None, out, p)
        return out


_DIRECT = 2  # a unit with at most this many parameters takes them on its own node (no _Attach chain)


def _wait_backward(emu: Emulation, step: _Step) -> None:
    # The gradients land as the pass starts (step.ahead) and the device's timeline runs on: the copies are a
    # DMA engine's in reality, and a unit too short to hide its own (an embedding's, at the end of the pass)
    # would otherwise hold the next pass back. The values are fixed: nothing reads a gradient before its
    # hook fires, after its unit's time.
    for q in step.ahead or step.params:
        land(q)
    emu.acc.run("layers", step.bwd_s, lazy=step is not emu.steps[0])  # the first unit ends the pass


def _grad_for(p):
    """What autograd gets for p: nothing where it landed (copied over the marked .grad), else the same realistic
    gradient each step, made once (no per-step random numbers or allocation)."""
    return None if not p.requires_grad or landed(p) else p._emulated_grad


class _Unit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, emu: Emulation, step: _Step, x, *params):
        emu.acc.run("layers", step.fwd_s, lazy=True)
        ctx.emu, ctx.step, ctx.params = emu, step, params
        ctx.x = (tuple(x.shape), x.dtype) if x.requires_grad else None
        return emu.zeros(step.call.output)

    @staticmethod
    def backward(ctx, grad):
        emu, step = ctx.emu, ctx.step
        if not step.params or ctx.params:  # with more parameters, the last _Attach waits
            _wait_backward(emu, step)
        return (None, None, emu.zeros(*ctx.x) if ctx.x is not None else None, *map(_grad_for, ctx.params))


class _Attach(torch.autograd.Function):
    """Passes the unit's output through; backward hands its parameter the fixed gradient (the last one attached
    first waits the unit's backward time)."""

    @staticmethod
    def forward(ctx, emu: Emulation, step, out, p):
        ctx.emu, ctx.step, ctx.p = emu, step, p
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if ctx.step is not None:
            _wait_backward(ctx.emu, ctx.step)
        return None, None, grad, _grad_for(ctx.p)


class _Reshape(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.spec = (tuple(x.shape), x.dtype)
        return torch.zeros((), dtype=x.dtype).expand(shape)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros((), dtype=ctx.spec[1]).expand(ctx.spec[0]), None


class _Loss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output):
        ctx.spec = (tuple(output.shape), output.dtype)
        return torch.zeros((), dtype=output.dtype)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros((), dtype=ctx.spec[1]).expand(ctx.spec[0])


def emulated_loss(output: torch.Tensor, target=None) -> torch.Tensor:
    """A scalar to call backward() on, without computing over the output (a [B, T, 32000] one included)."""
    return _Loss.apply(output)


def _template(p: nn.Parameter, g: torch.Generator) -> torch.Tensor:
    # Gaussian, at a scale that falls with fan-in as real gradients do; never zero, so top-k has something to pick.
    fan_in = p[0].numel() if p.dim() > 1 else p.numel()
    t = torch.empty(p.shape, dtype=p.dtype)
    t.normal_(0.0, 1e-2 / math.sqrt(max(1, fan_in)), generator=g)
    return t


def emulate(model: nn.Module, compute: ComputeModel | str, inputs: tuple, scale: float = 1.0, seed: int = 0,
            times: list[tuple[float, float]] | None = None) -> nn.Module:
    """The same model (same modules, parameters, buffers, dtypes), emulated in place: returns it.

    inputs: an example of what the model is called with (its shapes are traced on the meta device).
    Each unit's forward waits its modelled time on this process's accelerator (runtime.emulate.accelerator)
    and returns a tensor of the true shape that holds no memory; backward waits its time, fires the
    gradient hooks in the true order and hands each parameter a fixed gradient of the true size.
    """
    if getattr(model, "_emulation", None) is not None:
        raise EmulationError(f"{type(model).__name__} is emulated already")
    cm = compute_model(compute) if isinstance(compute, str) else compute
    acc = activate(active() or Accelerator(cm, scale))
    if acc.model is not cm and acc.model.label != cm.label:
        raise EmulationError(f"this process emulates {acc.model.label} already, not {cm.label}")
    inputs = tuple(inputs)
    tr = trace(model, inputs)
    times = cm.unit_times(tr) if times is None else times
    bad = [f"{c.name}: {f!r}/{b!r} s" for c, (f, b) in zip(tr.calls, times) if not (f >= 0 and b >= 0)]
    if bad:
        raise EmulationError(f"negative or missing times in {cm.label}: {', '.join(bad[:3])}")
    specs = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None for x in inputs]
    g = torch.Generator().manual_seed(seed)
    steps = []
    for i, (call, (f, b)) in enumerate(zip(tr.calls, times)):
        params = call.params + (tr.loose if i == 0 else ())
        # Attached in the reverse of the order their gradients arrive in the real model (see unit_forward).
        params = tuple(sorted(params, key=lambda p: -tr.grad_order.get(id(p), -1)))
        for p in params:
            if p.requires_grad and not hasattr(p, "_emulated_grad"):
                p._emulated_grad = _template(p, g)
        first = call.inputs[0] if call.inputs else None
        arg = next((j for j, s in enumerate(specs) if first is not None and s == (first.shape, first.dtype)), None)
        steps.append(_Step(call, f, b, arg if i == 0 or not first.dtype.is_floating_point else None, params))
    steps[-1].ahead = tuple(p for step in reversed(steps) for p in step.params)
    emu = Emulation(model, steps, tr.output, acc)
    for module in {id(c.module): c.module for c in tr.calls}.values():
        module.forward = emu.unit_forward
    model.forward = emu.forward
    model._emulation = emu
    return model


def optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """State values per element that the update reads and writes (ComputeModel.optimizer_s): Adam's two moments."""
    return 2 if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) else 1


def emulate_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer, its step() waiting the modelled time of the update instead of computing it."""
    acc = active()
    if acc is None:
        raise EmulationError("emulate the model first: the optimizer's step runs on its accelerator")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = optimizer_state(optimizer)

    zero_grad = optimizer.zero_grad

    def step(closure=None):
        loss = closure() if closure is not None else None
        # What this call updates, as torch's step would: the param groups as they are now (a wrapper's per-layer
        # update, runtime.updates.ParamUpdater, swaps in a layer's parameters), those with a gradient.
        stepped = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        acc.clock.begin()  # after whatever the host waited for (a DDP's last all-reduce, say)
        acc.run("optimizer", acc.model.optimizer_s(sum(p.numel() for p in stepped), len(stepped), state))
        return loss

    def emulated_zero_grad(set_to_none: bool = False):
        # Kept, not set to None, and not zeroed but marked: the next backward copies the fixed gradients over
        # them (runtime.emulate.landing) instead of allocating copies or zeroing and adding.
        with acc.device_work("zero_grad", acc.model.memset_s(4 * sum(p.numel() for p in params))):
            if not defer_zero(p for p in params if p.grad is not None):
                zero_grad(set_to_none=set_to_none)
    optimizer.step, optimizer.zero_grad = step, emulated_zero_grad
    return optimizer
