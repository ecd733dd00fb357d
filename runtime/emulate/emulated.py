"""emulate(): a model's units wait their modelled time instead of computing, with true-shaped outputs and gradients."""

# emulated_loss() and emulate_optimizer() for the rest of a step.

from __future__ import annotations

import operator
import time
import weakref
from dataclasses import dataclass, field
from itertools import chain, compress, repeat

import torch
from torch import nn

from .accelerator import Accelerator, activate, active
from .compute_model import ComputeModel, compute_model
from .clock import LAZY_AHEAD, LAZY_S
from .landing import defer_zero, land_ahead, marks
from .nodes import X_LEAF, X_NODE, X_NONE, Reshape, accumulation_order, apply_loss, apply_pass, apply_unit, x_kind
from .pattern import template
from .trace import Call, EmulationError, TensorSpec, trace
from .watch import WATCHED, Watch, global_hooks, hooked

__all__ = ["emulate", "emulated_loss", "emulate_optimizer", "optimizer_state", "Emulation"]


@dataclass
class _Step:
    call: Call
    fwd_s: float
    bwd_s: float
    arg: int | None  # which model input the unit takes as it is (the data, the tokens), else None
    # Those its node takes (those that take gradients: its own and those of the units it heads, _group), in
    # the order the real model accumulates them.
    params: tuple
    fwd_run: float = 0.0  # fwd_s and bwd_s times the compute scale
    bwd_run: float = 0.0
    inputs: dict = field(default_factory=dict)  # x_kind -> params, in the order a node takes them (nodes.py)
    own: tuple = ()  # its own parameters that take gradients, before _group handed them to a head


class Emulation:
    """What emulate() installed on a model: its steps, and the accelerator they run on.

    Where nothing watches a backward pass between its units (watch.Watch: no hook on a module, a parameter
    or a parameter's accumulator, no DDP around the model), the pass is one autograd node (nodes.Pass). So it
    is where only ready_aware parameter hooks watch it (a strategy's, whose staging thread waits for each
    gradient's ready time, as for a CUDA event): the node fires them in the true order as the pass starts
    (fire), each told when its gradient is ready (ready_at), as a GPU's host runs ahead of its backward. And
    so it is where only post-accumulate hooks watch it, some plain (a user's): the node runs the pass group by
    group and fires each group's hooks on time (fire_on_time), sparing the host autograd's node per group and
    accumulation per parameter, each run from caches gone cold in a wait.
    Otherwise (a hook on a module, a tensor or an accumulator, DDP's reducer) a unit gets a node when backward
    must reach it: it heads a group of parameters (_group), its input needs a gradient and no node came before
    it, or a hook may look (its module has hooks, or its input tensor has). The other units (ReLU, pooling,
    those in a group) only queue their time: their backward in the node before them, whose backward runs just
    after theirs would. Each node costs the host some microseconds of Python a pass; the units without one,
    next to nothing. A forward without module hooks makes its nodes once and runs them again (forward).
    """

    def __init__(self, model: nn.Module, steps: list[_Step], output: TensorSpec, acc: Accelerator, specs: tuple = ()):
        self.model, self.steps, self.output, self.acc = model, steps, output, acc
        self.specs = specs  # each input's (shape, dtype) as traced, None where not a tensor (forward checks)
        self.ref = weakref.ref(self)  # what its nodes hold (nodes.Unit)
        # Their gradients land as a forward starts (landing.land_ahead); in the order backward reaches them.
        self.params = tuple(p for step in reversed(steps) for p in step.params)
        # When each of them is ready, in seconds after its pass's backward starts: once its own unit's backward
        # and those of the units after it ran (not its group head's: fire() tells each its own unit's time).
        done, ready = 0.0, {}
        for step in reversed(steps):
            done += step.bwd_run
            ready.update((id(p), done) for p in step.own)
        self._ready_s = tuple(ready.get(id(p), done) for p in self.params)
        self._zeros: dict[torch.dtype, torch.Tensor] = {}
        self.forward_s = sum(s.fwd_s for s in steps)
        self.backward_s = sum(s.bwd_s for s in steps)
        self.forward_run = self.forward_s * acc.scale
        self.modules = tuple({id(s.call.module): s.call.module for s in steps}.values())
        self.clock = acc.clock
        self.all_landed = False  # this backward pass landed every gradient (landing.land_all)
        self._marks = -1  # landing.marks() when a forward last landed ahead
        # A pass's backward seconds without the input's gradient (from the first unit with parameters) and with it.
        bwd = [s.bwd_run for s in steps]
        first = next((i for i, s in enumerate(steps) if s.params), len(steps))
        self._pass_s = (sum(bwd[first:]), sum(bwd))
        # Each group's backward seconds (its head's and those of the units after it up to the next group's head)
        # and its parameters, in the order backward reaches them (fire_on_time).
        groups, span = [], 0.0
        for step in reversed(steps):
            span += step.bwd_run
            if step.params:
                groups.append((span, step.params))
                span = 0.0
        self._groups = tuple(groups)  # their seconds add up to _pass_s[0]: the pass from the first unit with parameters
        self.anchor = torch.zeros((), requires_grad=True)  # what the Pass node hangs on (its gradient: none)
        self.watch = Watch(self.modules, (p for p in self.params if p.requires_grad))
        self._chain = None  # the output of the nodes a forward without module hooks made (forward: made again)
        self._owed = 0.0  # forward time queued, not run yet (owe)
        self._pass = None  # this forward's [last node's ctx, first node's ctx, backward seconds]

    def zeros(self, spec_or_shape, dtype=None) -> torch.Tensor:
        """A tensor of this shape that holds no memory: one zero, every stride 0 (a fresh view each call)."""
        shape, dtype = (spec_or_shape.shape, spec_or_shape.dtype) if dtype is None else (spec_or_shape, dtype)
        base = self._zeros.get(dtype)
        if base is None:
            base = self._zeros[dtype] = torch.zeros((), dtype=dtype)
        return base.expand(shape)

    def owe(self, seconds: float) -> None:
        """Queue a unit's forward time. Nothing outside sees a forward's progress but a module's hook (P3's
        gate, a strategy's capture), so the time runs as a hooked module is called, and when the pass ends."""
        self._owed += seconds

    def _run_owed(self) -> None:
        if self._owed:
            self.clock.run(self._owed, lazy=True)
            self._owed = 0.0

    def forward(self, *inputs):
        # The units answer with the traced shapes and times whatever they are given: another input would run
        # on silently at the traced batch. A tuple compare, nothing measurable next to a pass.
        if tuple(map(_spec, inputs)) != self.specs:
            self._refuse(inputs)
        self.clock = self.acc.clock  # this thread's stream (a pipeline's stage may run on another thread)
        self.clock.begin(time.perf_counter())  # the pass starts now, though its time runs later (owe)
        self._owed, self._pass = 0.0, [None, None, 0.0]
        hooks = global_hooks()
        grad = torch.is_grad_enabled()
        if grad and self._marks != marks():  # a pipeline's later micro-batches: nothing new
            self._marks = marks()
            land_ahead(self.params, self.forward_run + self._pass_s[1])
        if hooks or self.watch.modules_hooked():
            link = self._each_unit(inputs, hooks)
        elif not grad:
            self._owed, link = self.forward_run, None  # nothing to differentiate: no node at all
        elif (watched := self.watch.backward_watched(self._chain is not None)) != WATCHED:
            self._owed, link = self.forward_run, self._whole(inputs, watched)
        elif self._replayable(inputs) and self._chain is not None:
            # Autograd can run a chain of nodes that save no tensors any number of times; a fresh node on
            # top makes this forward's output.
            self._owed, link = self.forward_run, Reshape.apply(self._chain, self.output.shape, self.output.dtype)
        else:
            link = self._each_unit(inputs, hooks)
            if link is not None and link.grad_fn is not None and self._replayable(inputs):
                self._chain = link
        # The pass's first and last nodes were for this forward's own use: held on, they would keep its graph,
        # and the hooks a strategy put on its tensors (hybcomm's capture), alive until the next forward, and
        # past the strategy's close: a cycle through autograd's C++ nodes, which the collector cannot see.
        self._pass = None
        self._run_owed()
        self.clock.sync()  # the layers ran lazily: the pass ends when its last one does
        self.acc.account("layers", self.forward_run, len(self.steps))
        if link is None:
            return self.zeros(self.output)
        if tuple(link.shape) != self.output.shape or link.dtype != self.output.dtype:
            link = Reshape.apply(link, self.output.shape, self.output.dtype)
        return link

    def _refuse(self, inputs) -> None:
        def said(spec):
            return "not a tensor" if spec is None else f"{spec[0]} {str(spec[1]).removeprefix('torch.')}"
        got = [_spec(x) for x in inputs]
        at = next((i for i, (a, b) in enumerate(zip(got, self.specs)) if a != b), None)
        what = (f"input {at} {said(got[at])}, traced with {said(self.specs[at])}" if at is not None else
                f"{len(got)} inputs, traced with {len(self.specs)}")
        raise EmulationError(f"emulated {type(self.model).__name__} called with {what}: its outputs and times are "
                             "the traced input's; emulate it again with this input, or keep the batch shape fixed "
                             "(e.g. DataLoader(drop_last=True))")

    def _whole(self, inputs, watched: int):
        """A forward whose backward nothing watches between its units but parameters' post-accumulate hooks,
        which the node fires (watch.AHEAD, watch.ON_TIME): one node (nodes.Pass) for the pass, on the input where
        it takes a gradient (a pipeline stage's), else on a leaf of its own (the anchor)."""
        x = inputs[self.steps[0].arg] if self.steps[0].arg is not None else None
        if x is None or not x.requires_grad:
            return apply_pass(self, self._pass_s[0], self.anchor, watched)
        return apply_pass(self, self._pass_s[1], x, watched)

    def fire(self, start: float) -> None:
        """Run the ready_aware post-accumulate-grad hooks of every parameter that takes a gradient, in the order
        the real backward would, each with ready_at() saying when its gradient is ready: `start` (when the pass's
        backward starts on the device) plus the backward time of its unit and of those after it."""
        clock = self.clock
        try:
            for p, seconds in zip(self.params, self._ready_s):
                hooks = p._post_accumulate_grad_hooks
                if hooks and p.requires_grad:
                    clock.ready_at = start + seconds
                    for hook in tuple(hooks.values()):
                        hook(p)
        finally:
            clock.ready_at = None

    def fire_on_time(self, seconds: float) -> None:
        """Queue a pass's `seconds` of backward group by group (_group: a group's units, its head last) and run
        the post-accumulate hooks of each group's parameters once its time is done, in the true order, as the
        unit-by-unit backward's nodes would (lazily: up to LAZY_S early), but without autograd's node per group
        and accumulation per parameter; the rest of the pass (the units before the first with parameters, for
        the input's gradient) is queued without a wait."""
        clock, last = self.clock, len(self._groups) - 1
        for i, (group_s, params) in enumerate(self._groups):
            # The last group too, waking ahead of its end: the host goes on to the optimizer step, queued after
            # the pass as a GPU's host launches it before the backward ends (Pass waits for the end where it
            # hands back the input's gradient).
            clock.run(group_s, lazy=True, ahead=LAZY_AHEAD if i == last else 0.0)
            for p in params:
                hooks = p._post_accumulate_grad_hooks
                if hooks and p.requires_grad:
                    for hook in tuple(hooks.values()):
                        hook(p)
        clock.run(max(0.0, seconds - self._pass_s[0]), wait=False)

    def _replayable(self, inputs) -> bool:
        """With no hook to see the units (the caller checked), no input that needs a gradient and every
        parameter taking one, a forward's nodes would be the same ones each time: the first's run again."""
        return not _needs_grad(inputs) and all(p.requires_grad for p in self.params)

    def _each_unit(self, inputs, hooks: bool):
        """A forward that calls each unit (the hooked ones as the user's code would) and makes its nodes;
        hooks: global module hooks are registered (every unit is called through its module)."""
        link = None
        for step in self.steps:
            module = step.call.module
            if hooks or hooked(module):
                # Called as the user's code would call it: its hooks see the true input and output shapes.
                self._run_owed()  # a pre-hook may block (P3's gate): the work queued before it runs meanwhile
                spec = step.call.inputs[0] if step.call.inputs else step.call.output
                self._cursor = (step, link, True)
                out = module(inputs[step.arg] if step.arg is not None else self.zeros(spec))
                link = out if out.requires_grad or link is None else link
            else:
                link = self._unit(step, link, inputs[step.arg] if step.arg is not None else None, False)
        self._cursor = None
        last, first, seconds = self._pass
        if last is not None:
            last.ahead = True
            first.ends, first.pass_s = True, seconds
        return link

    def unit_forward(self, *args, **kwargs):
        step, link, hooked = self._cursor
        return self._unit(step, link, args[0] if args else None, hooked)

    def _unit(self, step: _Step, link, arg, hooked: bool):
        x = link if link is not None else arg
        if step.params or (x is not None and (x.requires_grad and (link is None or hooked or
                                                                     link._backward_hooks is not None))):
            if x is None:
                x = self.zeros(step.call.inputs[0] if step.call.inputs else step.call.output)
            out = apply_unit(self, step, x, step.inputs[x_kind(x)])
            if out.requires_grad:
                ctx, state = out.grad_fn, self._pass
                state[0] = ctx
                state[1] = state[1] or ctx
                state[2] += ctx.bwd
            return out
        self.owe(step.fwd_run)
        last = self._pass[0]
        if last is not None:  # its backward runs just before the node before it does: that node waits it
            last.bwd += step.bwd_run
            self._pass[2] += step.bwd_run
        return self.zeros(step.call.output) if hooked else link


def _group(steps: list[_Step], grad_order: dict[int, int]) -> None:
    """Hand the parameters of each unit to the node of the unit before it that heads its group: a group is
    the units whose backward times add up to at most LAZY_S, so that one node's backward does for all of
    them (a third of ResNet-50's units on a V100; more on faster devices), and a unit whose backward alone
    outlasts LAZY_S heads its own.

    Each node's Python costs the host tens of microseconds when it runs right after a wake-up (the host's
    caches went cold while it slept), as most do. A group's gradients reach their hooks together, at the
    head's deadline: late by less than LAZY_S, the bound within which lazy waits let every hook run early
    anyway, and in the real order (the head's node takes them all in the order the engine accumulates
    them: nodes.accumulation_order).
    """
    head, span = None, 0.0
    for step in steps:
        if step.params and head is not None and span + step.bwd_run <= LAZY_S:
            head.params = tuple(sorted(head.params + step.params, key=lambda p: grad_order.get(id(p), -1)))
            step.params = ()
        elif step.params:
            head, span = step, 0.0
        span += step.bwd_run


def _spec(x):
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None


def _needs_grad(inputs) -> bool:
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)


def emulated_loss(output: torch.Tensor, target=None) -> torch.Tensor:
    """A scalar to call backward() on, without computing over the output (a [B, T, 32000] one included)."""
    return apply_loss(output)


def emulate(model: nn.Module, compute: ComputeModel | str, inputs: tuple, scale: float = 1.0, seed: int = 0,
            times: list[tuple[float, float]] | None = None) -> nn.Module:
    """The same model (same modules, parameters, buffers, dtypes), emulated in place: returns it.

    inputs: an example of what the model is called with, a tuple of its arguments or one tensor (its shapes are
    traced on the meta device).
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
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)  # a tensor's rows are not arguments
    tr = trace(model, inputs)
    times = cm.unit_times(tr) if times is None else list(times)
    if len(times) != len(tr.calls):
        raise EmulationError(f"{len(times)} (forward, backward) times for the {len(tr.calls)} units of "
                             f"{type(model).__name__}")
    bad = [f"{c.name}: {f!r}/{b!r} s" for c, (f, b) in zip(tr.calls, times) if not (f >= 0 and b >= 0)]
    if bad:
        raise EmulationError(f"negative or missing times in {cm.label}: {', '.join(bad[:3])}")
    specs = tuple(map(_spec, inputs))
    g = torch.Generator().manual_seed(seed)
    steps = []
    for i, (call, (f, b)) in enumerate(zip(tr.calls, times)):
        params = call.params + (tr.loose if i == 0 else ())
        for p in params:
            if p.requires_grad and not hasattr(p, "_emulated_grad"):
                p._emulated_grad = template(p, g)
        # Those that take gradients, in the order the real model accumulates them.
        params = tuple(sorted((p for p in params if p.requires_grad), key=lambda p: tr.grad_order.get(id(p), -1)))
        first = call.inputs[0] if call.inputs else None
        arg = next((j for j, s in enumerate(specs) if first is not None and s == (first.shape, first.dtype)), None)
        steps.append(_Step(call, f, b, arg if i == 0 or not first.dtype.is_floating_point else None, params,
                           f * acc.scale, b * acc.scale, own=params))
    _group(steps, tr.grad_order)
    for step in steps:
        for kind in (X_NONE, X_NODE, X_LEAF):  # the node's inputs, placed where the engine takes them in order
            placed = [None] * len(step.params)
            for p, at in zip(step.params, accumulation_order(len(step.params), kind)):
                placed[at] = p
            step.inputs[kind] = tuple(placed)
    emu = Emulation(model, steps, tr.output, acc, specs)
    for module in emu.modules:
        module.forward = emu.unit_forward
    model.forward = emu.forward
    model._emulation = emu
    return model


_PARAMS, _GRAD = operator.itemgetter("params"), operator.attrgetter("grad")


def _with_grad(params: list) -> list:
    """Those of params that have a gradient, without a Python loop per parameter (the optimizer's step runs
    right after a wait, from cold caches)."""
    return list(compress(params, map(operator.is_not, map(_GRAD, params), repeat(None))))


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
    memset_s = acc.model.memset_s(4 * sum(p.numel() for p in params))

    def step(closure=None):
        loss = closure() if closure is not None else None
        # What this call updates, as torch's step would: the param groups as they are now (a wrapper's per-layer
        # update, runtime.updates.ParamUpdater, swaps in a layer's parameters), those with a gradient.
        stepped = _with_grad(list(chain.from_iterable(map(_PARAMS, optimizer.param_groups))))
        acc.clock.begin()  # after whatever the host waited for (a DDP's last all-reduce, say)
        # Launched, not waited for (wait=False): the host goes on to zero_grad and the next forward, whose work
        # starts when this ends; a host that had to sleep to its end first would idle the device meanwhile.
        acc.run("optimizer", acc.model.optimizer_s(sum(map(torch.Tensor.numel, stepped)), len(stepped), state),
                wait=False)
        return loss

    def emulated_zero_grad(set_to_none: bool = False):
        # Kept, not set to None, and not zeroed but marked: the next forward writes the fixed gradients over
        # them (runtime.emulate.landing) instead of allocating copies or zeroing and adding.
        with acc.device_work("zero_grad", memset_s):
            if not defer_zero(params):
                zero_grad(set_to_none=set_to_none)
    optimizer.step, optimizer.zero_grad = step, emulated_zero_grad
    return optimizer
