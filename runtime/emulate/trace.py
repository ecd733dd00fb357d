"""What a model's forward calls, in order, with every call's input and output shapes: traced on the meta device."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Call", "Trace", "trace", "EmulationError"]


class EmulationError(ValueError):
    """A model, profile or device that cannot be emulated as asked: says which and why."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Call:
    """One call of a unit (a module whose forward calls no other module: a leaf, or one such as
    MultiheadAttention that uses its children's weights directly) in forward order."""

    name: str
    module: nn.Module
    inputs: tuple[TensorSpec, ...]
    output: TensorSpec
    params: tuple[nn.Parameter, ...] = field(default_factory=tuple)  # those it owns, first call only


@dataclass
class Trace:
    calls: list[Call]
    output: TensorSpec
    loose: tuple[nn.Parameter, ...]  # parameters no unit owns (used by a container's own forward)
    grad_order: dict[int, int]  # id(parameter) -> its place in the order backward accumulates gradients


def _spec(t) -> TensorSpec | None:
    if isinstance(t, torch.Tensor):
        return TensorSpec(tuple(t.shape), t.dtype)
    if isinstance(t, (tuple, list)) and t:
        return _spec(t[0])
    return None


def trace(model: nn.Module, inputs: tuple) -> Trace:
    """The units model(*inputs) calls, in order; on the meta device, so a 224x224 VGG costs nothing."""
    names = {m: n for n, m in model.named_modules()}
    stack: list[list] = []  # [module, called a child?] per open call
    calls: list[Call] = []

    def pre(module, args):
        if stack:
            stack[-1][1] = True
        stack.append([module, False])

    def post(module, args, out):
        opened, inner = stack.pop()
        if inner:
            return
        spec = _spec(out)
        if spec is None:
            raise EmulationError(f"{names[module] or type(module).__name__} returns no tensor: cannot emulate it")
        calls.append(Call(names[module], module, tuple(s for s in map(_spec, args) if s is not None), spec))

    handles = [m.register_forward_pre_hook(pre) for m in model.modules() if m is not model]
    handles += [m.register_forward_hook(post) for m in model.modules() if m is not model]
    params = dict(model.named_parameters())
    meta = {n: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad) for n, t in params.items()}
    meta.update({n: torch.empty_like(t, device="meta") for n, t in model.named_buffers()})
    fired: list[str] = []
    for n, t in meta.items():
        if n in params and t.requires_grad:
            handles.append(t.register_post_accumulate_grad_hook(lambda _, n=n: fired.append(n)))
    try:
        out = torch.func.functional_call(model, meta, tuple(_meta(x) for x in inputs), tie_weights=True)
        first = out if isinstance(out, torch.Tensor) else next(t for t in out if isinstance(t, torch.Tensor))
        if first.requires_grad:  # the true order of the gradients, on the meta device too
            torch.autograd.backward(first, torch.empty_like(first))
    except EmulationError:
        raise
    except Exception as e:  # noqa: BLE001 - an op without a meta kernel, or inputs that do not fit the model
        raise EmulationError(f"cannot trace {type(model).__name__} on the meta device: {type(e).__name__}: {e}") from e
    finally:
        for h in handles:
            h.remove()
    spec = _spec(out)
    if spec is not None and not calls and not any(True for _ in model.children()):
        # Units are the modules the model calls (each timed as the device would run it): a leaf has none.
        raise EmulationError(f"{type(model).__name__} is a single layer with no submodules: emulation times the "
                             f"modules a model calls; pass nn.Sequential(layer) instead")
    if spec is None or not calls:
        raise EmulationError(f"{type(model).__name__}: its forward returned no tensor or called no module")
    owned: set[int] = set()
    for c in calls:
        mine = [p for p in c.module.parameters() if id(p) not in owned]  # a reused module owns them once
        owned.update(id(p) for p in mine)
        c.params = tuple(mine)
    loose = tuple(p for p in model.parameters() if id(p) not in owned)
    return Trace(calls, spec, loose, {id(params[n]): i for i, n in enumerate(fired)})


def _meta(x):
    # Detached: a leaf that needs a gradient (a pipeline stage's input) stays one, on the meta device.
    return x.detach().to("meta").requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
