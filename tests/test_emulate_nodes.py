"""runtime.emulate's nodes: a backward nothing watches is one node, units without parameters need none, hooks
still see every unit, and a unit's many parameters reach their hooks in the real order."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
from torch import nn

from emulate_helpers import fresh_accelerator, is_pass, plain, unit_nodes, watch  # noqa: F401 - an autouse fixture
from runtime.emulate import accelerator, emulate, emulate_optimizer, emulated_loss
from runtime.emulate.pattern import LARGE, fixed
from runtime.emulate import clock as clock_module
from runtime.emulate.clock import LAZY_S
from runtime.emulate.nodes import X_LEAF, X_NODE, X_NONE, Unit, accumulation_order
from runtime.emulate.trace import trace
from runtime.workloads.models import build_model, model_input


def test_one_node_per_group_of_parameters_and_none_for_the_other_units():
    model = build_model("resnet50")
    inputs, _ = model_input("resnet50", 4)
    emulate(model, "v100", inputs)
    watch(model)
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


def test_a_forward_without_module_hooks_runs_the_first_ones_nodes_again_until_a_hook_comes():
    model = build_model("cnn")
    inputs, _ = model_input("cnn", 4)
    emulate(model, "v100", inputs)
    watch(model)
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    nodes = []
    for _ in range(3):
        opt.zero_grad()
        out = model(*inputs)
        nodes.append(out.grad_fn.next_functions[0][0])
        emulated_loss(out).backward()
        assert all(torch.equal(p.grad, fixed(p)) for p in model.parameters())
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


@pytest.mark.parametrize("hooks", [plain, watch], ids=["plain", "accumulator"])
@pytest.mark.parametrize("needs_grad", [False, True])
def test_a_unit_with_six_parameters_accumulates_them_in_the_real_order(needs_grad, hooks):
    def order_of(model, x, loss):
        order = hooks(model)
        loss(model(x)).backward()
        return list(order)
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
    fired = watch(model)
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        opt.zero_grad()
        out = model(*inputs)
        emulated_loss(out).backward()
    assert model._emulation._chain is not None and fired
    del fired
    gone = weakref.ref(model)
    del model, opt  # out lives on, as a loop's variable does: the chain is not the emulation's alone
    gc.collect()
    assert gone() is None


def test_a_backward_nothing_watches_is_one_node_that_lands_every_gradient_and_sleeps_once():
    model = build_model("resnet50")
    inputs, _ = model_input("resnet50", 4)
    # 0.5 s a backward: it sleeps, with room for a slow host's landing before the check that it has not ended.
    emulate(model, "v100", inputs, times=[(0.0001, 0.005)] * len(trace(model, inputs).calls))
    emu, acc = model._emulation, accelerator.active()
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(3):
        opt.zero_grad()
        out = model(*inputs)
        assert is_pass(out)
        layers, wakes = acc.seconds["layers"], acc.clock.wakes
        emulated_loss(out).backward()
        # As a GPU's host, it launched the backward and did not wait for it; the next work, or a sync, waits
        # for the whole pass in one sleep.
        assert acc.clock.wakes == wakes and acc.clock.deadline > time.perf_counter()
        acc.clock.sync()
        assert acc.clock.wakes - wakes == 1
        backward_s = acc.seconds["layers"] - layers
        # Made on the first step, copied over the marked buffers after it: no allocation.
        assert all(torch.equal(p.grad, fixed(p)) for p in model.parameters())
        if step == 1:
            buffers = [p.grad.data_ptr() for p in model.parameters()]
    assert [p.grad.data_ptr() for p in model.parameters()] == buffers
    accumulated = acc.seconds["accumulate"]
    emulated_loss(model(*inputs)).backward()  # no zero_grad: the second micro-batch's gradient adds to the first
    # ... on the device: modelled time; the host adds the small ones and leaves a LARGE one's values as they are.
    assert acc.seconds["accumulate"] > accumulated
    assert all(torch.equal(p.grad, (1 if p.numel() >= LARGE else 2) * fixed(p)) for p in model.parameters())
    watch(model)
    out = model(*inputs)
    layers = acc.seconds["layers"]
    emulated_loss(out).backward()
    assert not is_pass(out) and acc.seconds["layers"] - layers == pytest.approx(backward_s)  # unit by unit: the same
    assert emu.steps[0].params and backward_s == pytest.approx(sum(s.bwd_run for s in emu.steps))


def test_a_stage_input_gets_its_gradient_from_the_one_node():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.zeros(2, 8, requires_grad=True)
    emulate(model, "v100", (x,))
    out = model(x)
    emulated_loss(out).backward()
    assert is_pass(out) and x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is not None for p in model.parameters())


def test_a_module_hook_that_comes_and_goes_after_the_first_forward_is_seen_each_time():
    model = build_model("cnn")
    inputs, _ = model_input("cnn", 4)
    emulate(model, "v100", inputs)
    assert is_pass(model(*inputs))
    linear, seen = next(m for m in model.modules() if isinstance(m, nn.Linear)), []
    handle = linear.register_forward_hook(lambda *_: seen.append(1))
    assert not is_pass(model(*inputs)) and seen == [1]
    handle.remove()
    assert is_pass(model(*inputs)) and seen == [1]
    linear._forward_hooks.update({-1: lambda *_: seen.append(2)})  # not through register_forward_hook
    assert not is_pass(model(*inputs)) and seen == [1, 2]
    linear._forward_hooks.clear()
    assert is_pass(model(*inputs))


def test_the_emulation_benchmark_reports_each_step_with_and_without_parameter_hooks(tmp_path):
    import json

    from jobs.bench import emulation as bench
    out = tmp_path / "emulation.json"
    assert bench.main(["--models", "cnn", "--devices", "v100", "--steps", "2", "--warmup", "1", "--waits", "10",
                       "--repeats", "1", "--json", str(out)]) == 0
    steps = [r for r in json.loads(out.read_text())["rows"] if r["table"] == "steps"]
    assert [r["hooks"] for r in steps] == ["none", "ready-aware", "plain", "accumulator"]
    assert (tmp_path / "emulation.png").exists()
    for r in steps:  # the landing is part of the step's host time, and measured in it
        assert 0 < r["landing_cpu_s"] < r["host_cpu_s"] and r["grad_copy_cpu_s"] > 0
        assert r["host_rest_share"] * r["modelled_s"] == pytest.approx(max(0.0, r["host_rest_s"]))


@pytest.mark.parametrize("watched", [False, True])
def test_a_parameter_frozen_after_a_step_keeps_the_zeroed_gradient_zero_grad_left_it(watched):
    model = build_model("cnn")
    inputs, _ = model_input("cnn", 4)
    emulate(model, "v100", inputs)
    if watched:
        watch(model)
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    emulated_loss(model(*inputs)).backward()
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    opt.zero_grad()  # kept and marked, not zeroed yet: the next backward copies over the marks
    emulated_loss(model(*inputs)).backward()
    assert not frozen.grad.any()
    assert all(torch.equal(p.grad, fixed(p)) for p in model.parameters() if p is not frozen)


