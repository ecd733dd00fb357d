"""runtime.emulate's nodes: units without parameters need none, hooks still see every unit, and a unit's many
parameters reach their hooks in the real order."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from runtime.emulate import accelerator, emulate, emulate_optimizer, emulated_loss
from runtime.emulate import clock as clock_module
from runtime.emulate.clock import LAZY_S
from runtime.emulate.nodes import X_LEAF, X_NODE, X_NONE, Unit, accumulation_order
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


def test_one_node_per_group_of_parameters_and_none_for_the_other_units():
    model = build_model("resnet50")
    inputs, _ = model_input("resnet50", 4)
    emulate(model, "v100", inputs)
    steps = model._emulation.steps
    heads = [s for s in steps if s.params]
    assert unit_nodes(model(*inputs)) == len(heads) < sum(1 for s in steps if s.call.params) < len(steps)
    assert sum(len(s.params) for s in heads) == len(list(model.parameters()))
    head = 0
    for i, s in enumerate(steps):
        span = sum(t.bwd_run for t in steps[head:i + 1])
        if s.params:  # a new group: the last one could not take this unit within LAZY_S
            assert i == 0 or span > LAZY_S or not any(t.call.params for t in steps[head:i])
            head = i
        elif s.call.params:  # carried: its gradients are late by less than LAZY_S
            assert span <= LAZY_S


def test_a_forward_without_hooks_runs_the_first_ones_nodes_again_until_a_hook_comes():
    model = build_model("cnn")
    inputs, _ = model_input("cnn", 4)
    emulate(model, "v100", inputs)
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    nodes = []
    for _ in range(3):
        opt.zero_grad()
        out = model(*inputs)
        nodes.append(out.grad_fn.next_functions[0][0])
        emulated_loss(out).backward()
        assert all(torch.equal(p.grad, p._emulated_grad) for p in model.parameters())
    assert nodes[1] is nodes[2] and isinstance(nodes[1], Unit._backward_cls)
    seen = []
    linear = next(m for m in model.modules() if isinstance(m, nn.Linear))
    linear.register_forward_hook(lambda mod, args, out: seen.append(out.requires_grad))
    out = model(*inputs)
    assert seen == [True] and out.grad_fn.next_functions[0][0] is not nodes[2]  # fresh nodes: the hook looks
    with torch.no_grad():
        assert model(*inputs).grad_fn is None and seen == [True, False]


def test_a_stage_input_that_needs_a_gradient_gets_it_through_a_first_unit_without_parameters():
    model = nn.Sequential(nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    x = torch.zeros(2, 8, requires_grad=True)  # a pipeline stage's received activation
    emulate(model, "v100", (x,))
    emulated_loss(model(x)).backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_a_forward_without_hooks_sleeps_once_and_a_hooked_module_runs_the_time_before_it(monkeypatch):
    model = build_model("mlp", hidden=[256, 256, 256])
    inputs, _ = model_input("mlp", 8)
    n = len(trace(model, inputs).calls)
    emulate(model, "v100", inputs, times=[(0.002, 0.0)] * n)
    sleeps = []
    real_sleep = clock_module.Clock._sleep
    monkeypatch.setattr(clock_module.Clock, "_sleep", lambda self, left: (sleeps.append(left), real_sleep(self, left)))
    with torch.no_grad():
        model(*inputs)
    assert len(sleeps) == 1 and sum(sleeps) == pytest.approx(0.002 * n, abs=0.002)
    sleeps.clear()
    seen = []
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    last.register_forward_pre_hook(lambda mod, args: seen.append(len(sleeps)))
    with torch.no_grad():
        model(*inputs)
    assert seen == [1]  # the units before the hooked one ran their time before its hook was called
    assert sum(sleeps) == pytest.approx(0.002 * n, abs=0.002)


# The module is called with a stand-in input of the true shape (no gradient): torch says so, rightly.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_module_hooks_on_a_unit_without_parameters_see_it_forward_and_backward():
    model = build_model("cnn")
    inputs, _ = model_input("cnn", 4)
    emulate(model, "v100", inputs)
    relu = next(m for m in model.modules() if isinstance(m, nn.ReLU))
    seen = []
    relu.register_forward_hook(lambda mod, args, out: seen.append(("forward", tuple(out.shape))))
    relu.register_full_backward_hook(lambda mod, gin, gout: seen.append(("backward", tuple(gout[0].shape))))
    emulated_loss(model(*inputs)).backward()
    shape = seen[0][1]
    assert ("forward", shape) in seen and ("backward", shape) in seen


class Many(nn.Module):
    """One unit with six parameters, used in an order of its own."""

    def __init__(self):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(4, 4)) for _ in range(6))

    def forward(self, x):
        for k in (3, 0, 5, 1, 4, 2):
            x = x @ self.ps[k]
        return x


@pytest.mark.parametrize("needs_grad", [False, True])
def test_a_unit_with_six_parameters_accumulates_them_in_the_real_order(needs_grad):
    def order_of(model, x, loss):
        order = []
        for n, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _, n=n: order.append(n))
        loss(model(x)).backward()
        return order
    x = torch.randn(2, 4, requires_grad=needs_grad)
    real = order_of(nn.Sequential(nn.Linear(4, 4), Many()), x, lambda out: out.sum())
    model = nn.Sequential(nn.Linear(4, 4), Many())
    emulate(model, "v100", (x,))
    assert order_of(model, x, emulated_loss) == real
    assert sorted(accumulation_order(6, X_NODE)) == list(range(6))
    assert {len(accumulation_order(n, k)) for n in (0, 1, 7) for k in (X_NONE, X_LEAF)} == {0, 1, 7}


def test_an_emulated_model_whose_nodes_run_again_is_freed_with_its_last_user():
    model = build_model("cnn")
    inputs, _ = model_input("cnn", 4)
    emulate(model, "v100", inputs)
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        opt.zero_grad()
        out = model(*inputs)
        emulated_loss(out).backward()
    assert model._emulation._chain is not None
    gone = weakref.ref(model)
    del model, opt  # out lives on, as a loop's variable does: the chain is not the emulation's alone
    gc.collect()
    assert gone() is None
