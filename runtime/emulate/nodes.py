"""The emulated model's autograd nodes: one per unit that backward must reach, with its parameters in the order the engine accumulates them."""

from __future__ import annotations

import torch

from .landing import land_all, land_pass, take
from .clock import LAZY_AHEAD
from .watch import AHEAD, ON_TIME, UNWATCHED

__all__ = ["Unit", "Pass", "apply_loss", "apply_pass", "apply_unit", "Reshape", "Loss", "X_NONE", "X_NODE",
           "X_LEAF", "accumulation_order", "x_kind"]


class Unit(torch.autograd.Function):
    """A unit's node: forward queues its modelled time (Emulation.owe) and returns a zero-stride tensor of the
    unit's output shape; backward waits its backward time (and that of the units without a node after it:
    their gradients flow through it, at their true place on the timeline), lands the step's gradients that
    the forward did not (landing.land_ahead) if it is the first node backward reaches, and hands autograd the input's gradient and, for each parameter,
    nothing (landed) or the fixed gradient."""

    @staticmethod
    def forward(ctx, emu, step, x, *params):
        emu.owe(step.fwd_run)
        # A weak reference: the emulation keeps a forward's nodes to run again (Emulation.forward), and a strong
        # one back would make a cycle through autograd's C++ nodes that Python's collector cannot see (every
        # emulated model, its gradients and their templates, would outlive its last user).
        ctx.emu, ctx.params, ctx.bwd, ctx.ahead, ctx.ends = emu.ref, params, step.bwd_run, False, False
        ctx.none = (None,) * len(params)
        ctx.x = emu.zeros(tuple(x.shape), x.dtype) if x.requires_grad else None  # x's gradient: no memory
        return emu.zeros(step.call.output)

    @staticmethod
    def backward(ctx, grad):
        emu = _alive(ctx)
        if ctx.ahead:
            # The first node backward reaches lands every gradient, and the device's timeline runs on: the
            # copies are a DMA engine's in reality, and a unit too short to hide its own (an embedding's, at the
            # end of the pass) would otherwise hold the next pass back. The values are fixed: nothing reads a
            # gradient before its hook fires, after its unit's time.
            emu.all_landed = land_all(emu.params)
        # The node nearest the input ends the pass on its deadline where it hands back the input's gradient (a
        # pipeline stage's, sent on at once); else lazily, as every other node, and waking ahead of the end: the
        # host goes on to the optimizer step, which starts on the device when the pass ends, as a GPU's host
        # launches it before that.
        # emu.clock: the clock of the thread that ran the forward, which runs the backward too.
        last = ctx.ends and ctx.x is None
        emu.clock.run(ctx.bwd, lazy=not ctx.ends or last, ahead=LAZY_AHEAD if last else 0.0)
        grads = ctx.none if emu.all_landed else take(ctx.params)
        if ctx.ends:
            emu.all_landed = False
            emu.acc.account("layers", ctx.pass_s, 0)
        return (None, None, ctx.x, *grads)


class Pass(torch.autograd.Function):
    """A whole backward pass in one node, where nothing watches it between its units but the parameters'
    post-accumulate hooks (watch.Watch): it lands the step's gradients that the forward did not
    (landing.land_pass), queues the pass's backward time once and fires the hooks as they are all ready_aware
    ones (ahead: Emulation.fire), or queues it group by group and fires each group's hooks on time
    (Emulation.fire_on_time); it waits once if it must, as a GPU's host synchronizes once, and hands autograd
    the input's gradient. The parameters are not its inputs: their accumulations, and autograd's node for each
    group, would cost the host more than the rest of the pass (each run from caches gone cold in a wait)."""

    @staticmethod
    def forward(ctx, emu, seconds, x, watched):
        ctx.emu, ctx.bwd, ctx.watched = emu.ref, seconds, watched
        ctx.x = emu.zeros(tuple(x.shape), x.dtype) if x is not emu.anchor else None
        return emu.zeros(emu.output)

    @staticmethod
    def backward(ctx, grad):
        emu = _alive(ctx)
        land_pass(emu.params)
        clock = emu.clock
        if ctx.watched == ON_TIME:
            emu.fire_on_time(ctx.bwd)
        else:
            clock.run(ctx.bwd, wait=False)
        emu.acc.account("layers", ctx.bwd, 0)
        if ctx.watched == AHEAD:
            emu.fire(clock.deadline - ctx.bwd)
        # A pass that hands back no input gradient (none but a pipeline stage's does) ends unseen: as a GPU's
        # host, which launches the backward and goes on to the optimizer step, this one does not wait for it
        # to end; the next work starts when it does.
        if ctx.x is not None:
            clock.sync()
        return None, None, ctx.x, None


def _alive(ctx):
    emu = ctx.emu()
    if emu is None:
        raise RuntimeError("backward through an emulated model that is gone (nothing references it any more)")
    return emu


def apply_unit(emu, step, x, params):
    """Unit.apply, without torch.autograd.Function.apply's Python (a third of an emulated forward's host time)
    where no functorch transform is active: Function.apply then only calls the C++ apply."""
    if torch._C._are_functorch_transforms_active():
        return Unit.apply(emu, step, x, *params)
    return _c_apply(emu, step, x, *params)


def apply_pass(emu, seconds, x, watched=UNWATCHED):
    """Pass.apply, the way apply_unit calls Unit's."""
    if torch._C._are_functorch_transforms_active():
        return Pass.apply(emu, seconds, x, watched)
    return _c_apply_pass(emu, seconds, x, watched)


def apply_loss(output):
    """Loss.apply, the way apply_unit calls Unit's (the loss too runs right after a wait, from cold caches)."""
    if torch._C._are_functorch_transforms_active():
        return Loss.apply(output)
    return _c_apply_loss(output)


class Reshape(torch.autograd.Function):
    """The model's output where its last unit with a node returns another shape or dtype."""

    @staticmethod
    def forward(ctx, x, shape, dtype):
        ctx.spec = (tuple(x.shape), x.dtype)
        return torch.zeros((), dtype=dtype).expand(shape)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros((), dtype=ctx.spec[1]).expand(ctx.spec[0]), None, None


class Loss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output):
        ctx.spec = (tuple(output.shape), output.dtype)
        return torch.zeros((), dtype=output.dtype)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros((), dtype=ctx.spec[1]).expand(ctx.spec[0])


_c_apply = super(torch.autograd.Function, Unit).apply
_c_apply_pass = super(torch.autograd.Function, Pass).apply
_c_apply_loss = super(torch.autograd.Function, Loss).apply


# How the input x of a node stands in the graph: it needs no gradient, another node made it, or it is a leaf
# (a pipeline stage's received activation) whose gradient AccumulateGrad keeps.
X_NONE, X_NODE, X_LEAF = 0, 1, 2


def x_kind(x: torch.Tensor) -> int:
    if not x.requires_grad:
        return X_NONE
    return X_NODE if x.grad_fn is not None else X_LEAF


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *params):
        ctx.n = len(params)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * ctx.n


_orders: dict[tuple[int, int], tuple[int, ...]] = {}


def accumulation_order(n: int, kind: int) -> tuple[int, ...]:
    """The order in which the engine runs the AccumulateGrad of a node's n parameter inputs (their places among
    the inputs), measured once per (n, kind) on a node like the emulated ones.

    Every AccumulateGrad has the same priority in the engine's ready queue (a binary heap), so a node's two
    or three parameters come out in input order but four or more in a heap's order: a real layer's several
    parameters (an attention block's four, an LSTM's eight) still reach their hooks in the true order if they
    are handed to the node in the order that this measures.
    """
    key = (n, kind)
    if n < 2:
        return tuple(range(n))
    if key not in _orders:
        order: list[int] = []
        params = [torch.zeros(1, requires_grad=True) for _ in range(n)]
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda _, i=i: order.append(i))
        with torch.enable_grad():
            x = torch.zeros(1, requires_grad=kind != X_NONE)
            x = x * 1 if kind == X_NODE else x
            _Probe.apply(x, *params).sum().backward()
        if sorted(order) != list(range(n)):
            raise RuntimeError(f"autograd ran {len(order)} of {n} parameter accumulations of one node: {order}")
        _orders[key] = tuple(order)
    return _orders[key]
