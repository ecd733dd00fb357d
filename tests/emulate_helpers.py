"""What the emulation's node and hook tests share: a fresh accelerator per test, hooks of each kind, counts."""

from __future__ import annotations

import pytest
import torch

from runtime.emulate import accelerator, emulate, emulate_optimizer
from runtime.emulate.nodes import Pass, Unit
from runtime.emulate.trace import trace
from runtime.workloads.models import build_model, model_input


@pytest.fixture(autouse=True)
def fresh_accelerator():
    accelerator.deactivate()
    yield
    accelerator.deactivate()


def unit_nodes(out: torch.Tensor) -> int:
    """How many emulated units' nodes backward passes through from out."""
    seen, todo, count = set(), [out.grad_fn], 0
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        count += isinstance(fn, Unit._backward_cls)
        todo += [f for f, _ in fn.next_functions]
    return count



class Fired(list):
    """The names of the parameters whose hooks fired, in order; holds the accumulators hooked (held)."""



def watch(model) -> Fired:
    """A hook on every parameter's accumulator, as DDP's reducer and Horovod put theirs: the backward then goes
    unit by unit. Returns what fired."""
    fired = Fired()
    fired.held = [horovod_style(p, fired, n) for n, p in model.named_parameters()]
    return fired



def plain(model) -> list:
    """A plain (not ready_aware) post-accumulate hook on every parameter, as a user's: the one node fires them."""
    fired = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=n: fired.append(n))
    return fired



def emulated_resnet(backward_s: float):
    """ResNet-50 at batch 4, each unit 0.1 ms forward and backward_s backward, with an emulated SGD: the model,
    its inputs, its Emulation, the accelerator and the optimizer."""
    model = build_model("resnet50")
    inputs, _ = model_input("resnet50", 4)
    emulate(model, "v100", inputs, times=[(0.0001, backward_s)] * len(trace(model, inputs).calls))
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return model, inputs, model._emulation, accelerator.active(), opt



def is_pass(out: torch.Tensor) -> bool:
    return isinstance(out.grad_fn, Pass._backward_cls)



def horovod_style(p, fired, name=1):
    """A hook on the parameter's accumulator, as Horovod and DeepSpeed register theirs: invisible from the
    parameter, so the emulation sees only that somebody holds the accumulator."""
    acc = p.view_as(p).grad_fn.next_functions[0][0]
    acc.register_hook(lambda *_: fired.append(name))
    return acc
