"""What may watch an emulated model's pass between its units: hooks on its modules, its parameters or their accumulators, and DDP."""

from __future__ import annotations

import operator
import sys
from collections import OrderedDict

from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.modules import module as _module
from torch.nn.parallel import DistributedDataParallel

__all__ = ["AHEAD", "HookDict", "ON_TIME", "UNWATCHED", "WATCHED", "Watch", "global_hooks", "hooked", "ready_aware"]

# What watches a backward pass between its units (Watch.backward_watched): nothing; only parameter hooks that
# read when their gradient is ready (ready_aware), which the pass may fire ahead; only Python post-accumulate
# hooks on the parameters, which the pass fires itself, each group's on time; something that autograd must
# reach unit by unit (a module's or a tensor's hook, an accumulator's, DDP's reducer).
UNWATCHED, AHEAD, WATCHED, ON_TIME = 0, 1, 2, 3
READY_AWARE = "emulated_ready"  # the attribute ready_aware() sets on a hook


def ready_aware(hook):
    """Mark a post-accumulate-grad hook as one that may run before its gradient is ready on the emulated
    device, because it reads when that is (runtime.emulate.ready_at: a staging thread that waits for it, as
    one waits for a CUDA event): a backward watched only by such hooks runs ahead of the device, as a GPU's
    host does, and fires them in the true order without waking once per group. Returns the hook."""
    setattr(hook, READY_AWARE, True)
    return hook


def _aware(hooks) -> bool:
    return all(getattr(h, READY_AWARE, False) for h in hooks.values())


HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
_HOOKS = tuple(map(operator.attrgetter, HOOK_DICTS))
_POST_HOOKS, _TENSOR_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks"), operator.attrgetter("_backward_hooks")
_HELD_ONCE = max(map(sys.getrefcount, [object()]))  # an object that one list holds, as Watch holds each accumulator


class HookDict(OrderedDict):
    """A module's hook dict that marks its Watch stale when a hook comes or goes: looking at every module's
    hooks each forward would cost a ResNet-50's host ~0.15 ms a step, its caches cold after each wait."""

    def __init__(self, *args, stale: list | None = None, **kwargs):
        self._stale = stale if stale is not None else [True]
        super().__init__(*args, **kwargs)


def _marking(name):
    method = getattr(OrderedDict, name)

    def marked(self, *args, **kwargs):
        self._stale[0] = True
        return method(self, *args, **kwargs)
    marked.__name__ = name
    return marked


# Every way a hook comes or goes (torch registers with d[id] = hook and removes with del d[id]; the C
# OrderedDict's own pop, clear, update and setdefault do not go through those two).
for _name in ("__setitem__", "__delitem__", "pop", "popitem", "clear", "update", "setdefault"):
    setattr(HookDict, _name, _marking(_name))


class Watch:
    """Asked once per forward whether something may watch the pass between its units, for an emulated model's
    modules and parameters (those that take gradients). Where nothing does, the model's backward is one node
    (nodes.Pass) that sleeps once, as a GPU's host synchronizes once."""

    def __init__(self, modules, params):
        self._stale, self._hooked = [True], True
        self.modules = tuple(modules)
        for m in self.modules:
            for name in HOOK_DICTS:
                object.__setattr__(m, name, HookDict(getattr(m, name), stale=self._stale))
        self.params = tuple(params)
        # Kept: a hook on an accumulator (Horovod's, DeepSpeed's way) is invisible to Python, but whoever put
        # it there holds the accumulator too (autograd keeps one only while a graph or somebody holds it).
        self.accumulators = [get_gradient_edge(p).node for p in self.params]

    def modules_hooked(self) -> bool:
        """A module has a hook of its own (it is then called as the user's code would call it)."""
        if self._stale[0]:
            self._stale[0] = False
            self._hooked = any(any(map(hooks, self.modules)) for hooks in _HOOKS)
        return self._hooked

    def backward_watched(self, graph: bool) -> int:
        """Beyond the modules' hooks: a parameter's hook, a hook on a parameter's accumulator, or torch DDP's
        reducer, whose hooks on the accumulators are C++ (DDP's forward names itself while it calls the model's;
        an unknown torch counts as DDP). graph: the emulation keeps a graph that holds the accumulators.
        WATCHED, AHEAD (every hook is a post-accumulate one marked ready_aware), ON_TIME (every hook is a
        post-accumulate one, some not ready_aware) or UNWATCHED.

        Whoever holds an accumulator besides this Watch counts: one reference more for each holder in Python,
        and one for all holders in C++ together (torch keeps a node's Python object alive while C++ holds the
        node). C++ holders are a graph that uses the parameters (a unit-by-unit forward's, still alive) or
        DDP's reducer; when the emulation keeps such a graph itself, only Python holders can be told apart.
        """
        if getattr(DistributedDataParallel, "_active_ddp_module", True) is not None:
            return WATCHED
        params = self.params
        if (any(map(_TENSOR_HOOKS, params))
                or max(map(sys.getrefcount, self.accumulators), default=0) > _HELD_ONCE + graph):
            return WATCHED
        post = [h for h in map(_POST_HOOKS, params) if h]
        if not post:
            return UNWATCHED
        return AHEAD if all(map(_aware, post)) else ON_TIME


def hooked(m: nn.Module) -> bool:
    return any(hooks(m) for hooks in _HOOKS)


def global_hooks() -> bool:
    m = _module
    return bool(m._global_forward_pre_hooks or m._global_forward_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)
