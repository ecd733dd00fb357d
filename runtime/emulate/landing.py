"""Emulated gradients landing in host memory: zero_grad marks them, the first gradient of a step copies over them."""

from __future__ import annotations

import time

import torch

from .accelerator import active

__all__ = ["defer_zero", "land", "landed"]


_MARKED, _LANDED = 1, 2  # p._emulated_landing: zeroed by a mark; its fixed gradient copied over the mark


def defer_zero(params) -> bool:
    """Under emulation, mark these parameters' gradients instead of zeroing them, and say so (True).

    A GPU zeroes its gradients on the device and its staging copy then overwrites host memory, so zeroing
    the host's buffers here and adding the first gradient into them would cost the host two passes over
    the gradients that the GPU's host never makes: the first gradient to arrive is copied over the marked
    buffer instead (land()), and later ones (micro-batches) are added as autograd adds them. False (not
    emulating, or a parameter of a model that is not emulated): zero them as usual.
    """
    if active() is None:
        return False
    params = list(params)
    if not all(hasattr(p, "_emulated_grad") for p in params):
        return False
    for p in params:
        p._emulated_landing = _MARKED
    return True


def land(p: torch.nn.Parameter) -> None:
    """Copy p's fixed gradient over its marked .grad now (the emulated model calls it as the backward pass
    starts: the copy is host work that a GPU's DMA engine does, so it overlaps the modelled waits).
    A parameter with a tensor hook gets a zeroed .grad instead: autograd adds to it, and the hook sees it."""
    if getattr(p, "_emulated_landing", 0) != _MARKED:
        return
    grad = p.grad
    if grad is None:
        p._emulated_landing = 0
        return
    t = time.perf_counter()
    if p._backward_hooks:
        grad.zero_()
        p._emulated_landing = 0
    else:
        grad.copy_(p._emulated_grad)
        p._emulated_landing = _LANDED
    acc = active()
    if acc is not None:  # a DMA engine's copy in reality: it does not hold the device's next pass back
        acc.clock.absorb(time.perf_counter() - t)


def landed(p: torch.nn.Parameter) -> bool:
    """Whether p's gradient is in .grad already (land()): its backward then hands autograd no gradient for p,
    and p's AccumulateGrad still runs, adds nothing, and runs p's post-accumulate-grad hooks (ours, a DDP
    reducer's) where it would have added. False: autograd must accumulate it."""
    land(p)
    if getattr(p, "_emulated_landing", 0) == _LANDED:
        p._emulated_landing = 0
        return True
    return False
