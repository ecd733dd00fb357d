"""Emulated gradients landing in host memory: zero_grad marks them, the next forward writes the fixed ones over them."""

from __future__ import annotations

import time
import warnings
from collections import deque
from itertools import repeat

import torch

from .accelerator import active
from .pattern import ROW, firsts, fixed, write

__all__ = ["defer_zero", "land", "land_all", "land_ahead", "land_pass", "take"]


_MARKED, _LANDED = 1, 2  # p._emulated_landing: zeroed by a mark; its fixed gradient copied over the mark
_marks = [0]  # how many times defer_zero marked: a forward after none since the last has nothing to land ahead
# Landings in a row that outlasted their pass, and whether this process said so (land_ahead).
_slow = {"row": 0, "said": False}
SLOW_ROW = 3  # the first steps allocate and warm up: a host is called slow on this many in a row


def defer_zero(params) -> bool:
    """Under emulation, mark these parameters' gradients instead of zeroing them, and say so (True). A
    parameter without a gradient may be marked too: its first gradient is then made as it would have been.

    A GPU zeroes its gradients on the device and its staging copy then overwrites host memory, so zeroing
    the host's buffers here and adding the first gradient into them would cost the host two passes over
    the gradients that the GPU's host never makes: the first gradient to arrive is copied over the marked
    buffer instead (land()), and later ones (micro-batches) are added as autograd adds them. False (not
    emulating, or a parameter of a model that is not emulated): zero them as usual.
    """
    if active() is None:
        return False
    params = list(params)
    # C-level loops: zero_grad runs right after a wait, from cold caches.
    if not all(map(hasattr, params, repeat("_emulated_grad"))):
        return False
    deque(map(setattr, params, repeat("_emulated_landing"), repeat(_MARKED)), maxlen=0)
    _marks[0] += 1
    return True


def _dense_grad(p) -> bool:
    """Whether p has a .grad to land into: not None, nor the sparse placeholder of a deferred step's parameter
    (runtime.grad_buffers' park(), which a gradient made here replaces)."""
    g = p.grad
    return g is not None and g.layout is torch.strided


def marks() -> int:
    """How many times defer_zero has marked gradients (in this process): land_ahead has work only after a new one."""
    return _marks[0]


def land(p: torch.nn.Parameter) -> None:
    """Copy p's fixed gradient over its marked .grad now (the emulated model calls it as the backward pass
    starts: the copy is host work that a GPU's DMA engine does, so it overlaps the modelled waits).
    A parameter with a tensor hook gets a zeroed .grad instead: autograd adds to it, and the hook sees it."""
    land_all((p,))


def land_ahead(params, pass_s: float = 0.0) -> None:
    """As a forward that backward will follow starts: copy the fixed gradient over every marked .grad that
    autograd will not add to (no tensor hook, needing a gradient), and leave them landed for the backward.
    pass_s: the modelled forward and backward that the copies overlap; a host that writes slower than that
    (SLOW_ROW times in a row) is told once that its steps are its own memory's, not the device model's.

    On a GPU the copies are a DMA engine's during the pass, so they cost the step no time while they fit in it.
    Here they are the host's, on the pass's timeline: made as the forward starts, they overlap the forward's
    and the backward's modelled time (the clock's pass started before them), where made as the backward
    starts they outlasted a short backward (an H100's VGG-19: 29.6 ms of copies against 22 ms). Nothing
    reads a gradient before its hook fires, after its unit's backward time, so the values may land early."""
    t, cpu = time.perf_counter(), time.thread_time()
    copied = [p for p in params if getattr(p, "_emulated_landing", 0) == _MARKED and _dense_grad(p)
              and not p._backward_hooks and p.requires_grad]
    if copied:
        _land(copied)
        for p in copied:
            p._emulated_landing = _LANDED
    _landed(t, cpu, absorb=False)
    if copied and pass_s > 0:
        _pace(time.perf_counter() - t, pass_s, copied)


def _pace(seconds: float, pass_s: float, params) -> None:
    if seconds <= pass_s:
        _slow["row"] = 0
        return
    _slow["row"] += 1
    if _slow["row"] >= SLOW_ROW and not _slow["said"]:
        _slow["said"] = True
        nbytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
        warnings.warn(
            f"emulated compute is bound by this host's memory: writing the gradients into host memory "
            f"({nbytes / 1e6:.0f} MB, {nbytes / seconds / 1e9:.1f} GB/s) took {seconds * 1e3:.1f} ms, longer than "
            f"the modelled forward and backward ({pass_s * 1e3:.1f} ms) that a GPU's copy engine writes them "
            f"during: T_iter will exceed the device model's. Emulate on a host with faster memory, or a slower "
            f"device (--compute-scale)", RuntimeWarning, stacklevel=2)


def land_all(params) -> bool:
    """land() each of params (those not marked are left alone), the copies in one call; True when every one of
    them has its gradient now (copied here, or by land_ahead): then autograd gets nothing for any of them this
    pass (the nodes hand it no gradient without asking take()), and none is left marked or landed."""
    t, cpu = time.perf_counter(), time.thread_time()
    marked = [p for p in params if getattr(p, "_emulated_landing", 0) == _MARKED]
    copied = [p for p in marked if _dense_grad(p) and not p._backward_hooks and p.requires_grad]
    if copied:
        _land(copied)
    ahead = [p for p in params if getattr(p, "_emulated_landing", 0) == _LANDED]
    everything = len(copied) + len(ahead) == len(params)
    for p in marked:
        p._emulated_landing = 0
    if everything:
        for p in ahead:
            p._emulated_landing = 0
    else:
        for p in copied:
            p._emulated_landing = _LANDED
        for p in marked:  # zeroed as zero_grad would have: autograd adds to it, or (frozen since) leaves it
            if p.grad is not None and (p._backward_hooks or not p.requires_grad):
                p.grad.zero_()
    _landed(t, cpu)
    return everything


def _land(params) -> None:
    """Each one's fixed gradient over its .grad: a LARGE one written from its row scales (pattern.write: no
    full-size read) unless it still holds them, the others copied from their templates in one call."""
    small = []
    for p in params:
        rows, grad = getattr(p, "_emulated_rows", None), p.grad
        if rows is not None and grad.is_contiguous():
            if not _holds(p, grad):
                write(grad, rows)
                p._emulated_written = (grad, grad._version)
        elif rows is not None:  # a LARGE one keeps no template: made for a .grad that is not contiguous
            grad.copy_(fixed(p))
        else:
            small.append(p)
    if small:
        torch._foreach_copy_([p.grad for p in small], [p._emulated_grad for p in small])


def _holds(p, grad: torch.Tensor) -> bool:
    """Whether a LARGE gradient still holds the fixed values written last: the same tensor, which no torch op
    has changed in place since (its version counter, which its flat buffer's views share), and the first
    value of each row its own (a write torch does not see, MPI's into its memory, changes them).

    Nothing but the strategies changes a gradient between steps: a plain step (a benchmark's reference), or a
    strategy that leaves it as it is, then writes nothing, as a GPU's host writes nothing where its gradients
    stay on the device. A strategy that averages in place has it written again. A write behind torch's back
    that spares the first value of every row would go unseen: MPI's receives here fill whole buffers or
    slices whose averages, of the same fixed values on every rank, are those values to the last bit or two."""
    written = getattr(p, "_emulated_written", None)
    if written is None or written[0] is not grad or written[1] != grad._version:
        return False
    first = getattr(p, "_emulated_firsts", None)
    if first is None:
        first = p._emulated_firsts = firsts(p)
    return torch.equal(grad.view(-1)[::ROW], first)


def _landed(t: float, cpu: float, absorb: bool = True) -> None:
    acc = active()
    if acc is not None:  # a DMA engine's copy in reality: it does not hold the device's next pass back
        if absorb:
            acc.clock.absorb(time.perf_counter() - t)
        acc.landing_cpu_s += time.thread_time() - cpu


def land_pass(params) -> None:
    """Every one of params' gradients, for a backward pass that hands autograd none of them (nodes.Pass): the
    fixed gradient copied over a marked .grad, added to one that was not zeroed (micro-batches accumulate),
    or made where there is none (a parameter's first step: its one allocation). A parameter frozen since
    gets none (a marked .grad is zeroed, as zero_grad would have)."""
    t, cpu = time.perf_counter(), time.thread_time()
    marked, added, made = [], [], []
    for p in params:
        state = getattr(p, "_emulated_landing", 0)
        if state == _LANDED:  # by land_ahead, as the forward started
            p._emulated_landing = 0
        elif state == _MARKED:
            p._emulated_landing = 0
            if not p.requires_grad:
                if p.grad is not None:
                    p.grad.zero_()
            else:
                (marked if _dense_grad(p) else made).append(p)
        elif p.requires_grad:
            (added if _dense_grad(p) else made).append(p)
    if marked:
        _land(marked)
    if added:
        _add(added)
    for p in made:
        p.grad = fixed(p) if p._emulated_grad is None else p._emulated_grad.clone()
    _landed(t, cpu)


def _add(params) -> None:
    """Micro-batches accumulate: on a GPU autograd adds each one's gradient on the device, a pass over them at
    its memory's rate, queued here as modelled time ("accumulate"). The host adds the small ones' templates in
    one call, so their values are exactly the sum; a LARGE one (LARGE elements or more, row-scaled)
    keeps the values it holds, with no host pass: adding 100 MB a micro-batch on this host cost a stage of
    fc-heavy 0.85 s a step against its 10 ms of modelled compute. Nothing computes with those values (the
    emulated update does not): a LARGE gradient after micro-batches is the first one's, not their sum."""
    acc = active()
    if acc is not None:
        acc.run("accumulate", acc.model.pass_s(3 * sum(p.grad.numel() * p.grad.element_size() for p in params)),
                wait=False)
    rest = [p for p in params if p._emulated_grad is not None or not p.grad.is_contiguous()]
    if rest:
        torch._foreach_add_([p.grad for p in rest], [fixed(p) for p in rest])


def take(params) -> tuple:
    """What a node's backward hands autograd for each of params: nothing where the gradient landed (its
    AccumulateGrad adds nothing and still runs its hooks), else the fixed gradient: its template (no per-step
    random numbers or allocation), or a LARGE one's made from its row scales (an allocation, where autograd
    would have cloned a template it cannot take over; a LARGE parameter with a tensor hook pays it each pass).
    A frozen parameter gets nothing."""
    out = []
    for p in params:
        state = getattr(p, "_emulated_landing", 0)
        if state == _MARKED:
            land(p)
            state = p._emulated_landing
        if state == _LANDED:
            p._emulated_landing = 0
            out.append(None)
        else:
            out.append(fixed(p) if p.requires_grad else None)
    return tuple(out)
