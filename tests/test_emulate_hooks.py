"""runtime.emulate's parameter hooks: ready_aware ones fire ahead from the one node, plain ones on time from it,
the others (a tensor's, an accumulator's) make the backward go unit by unit; a watched backward's end."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from emulate_helpers import (  # noqa: F401 - fresh_accelerator: an autouse fixture
    emulated_resnet, fresh_accelerator, horovod_style, is_pass, plain, unit_nodes, watch)
from runtime.emulate import accelerator, emulate, emulate_optimizer, emulated_loss
from runtime.emulate.pattern import fixed
from runtime.emulate import clock as clock_module
from runtime.emulate.clock import LAZY_AHEAD, LAZY_S
from runtime.emulate.watch import ready_aware
from runtime.workloads.models import build_model, model_input


@pytest.mark.parametrize("how", ["tensor", "accumulator"])
def test_a_tensor_or_accumulator_hook_makes_the_backward_go_unit_by_unit(how):
    model = build_model("cnn")
    inputs, _ = model_input("cnn", 4)
    emulate(model, "v100", inputs)
    assert is_pass(model(*inputs))
    p, fired = next(model.parameters()), []
    if how == "tensor":
        handle = p.register_hook(lambda g: fired.append(1))
    else:
        held = horovod_style(p, fired)
    for _ in range(2):
        out = model(*inputs)
        assert not is_pass(out)
        emulated_loss(out).backward()
    assert fired == [1, 1]
    if how == "accumulator":
        del held
    else:
        handle.remove()
    assert is_pass(model(*inputs))  # nobody watches any more: the last output's graph is no watcher



def test_ready_aware_hooks_fire_ahead_in_the_real_order_each_told_when_its_gradient_is_ready():
    """A backward watched only by ready_aware hooks (a staged strategy's) stays one node that never wakes for
    them: it fires them all as it starts, in the order autograd fires plain hooks, each with ready_at() = the
    pass's start plus the backward time of its unit and of those after it, its gradient landed already."""
    model, inputs, emu, acc, opt = emulated_resnet(0.0002)  # a 20 ms backward
    seen = []

    def aware(p):
        seen.append((p, accelerator.ready_at(), torch.equal(p.grad, fixed(p))))
    handles = [p.register_post_accumulate_grad_hook(ready_aware(aware)) for p in model.parameters()]
    emulated_loss(model(*inputs)).backward()  # the gradients exist: the next ones land over them
    for _ in range(2):
        seen.clear()
        opt.zero_grad()
        out = model(*inputs)
        assert is_pass(out)
        wakes = acc.clock.wakes
        emulated_loss(out).backward()  # never slept: the hooks were not waited for
        assert acc.clock.wakes == wakes and accelerator.ready_at() is None
        start = acc.clock.deadline - emu._pass_s[0]
        assert len(seen) == len(list(model.parameters())) and all(landed for *_, landed in seen)
        readies = [r for _, r, _ in seen]
        assert readies == sorted(readies) and readies[-1] == pytest.approx(acc.clock.deadline)
        own = {id(p): i for i, s in enumerate(emu.steps) for p in s.own}
        for p, r, _ in seen:
            later = sum(s.bwd_run for s in emu.steps[own[id(p)]:])
            assert r == pytest.approx(start + later)
    ahead = [p for p, *_ in seen]
    for h in handles:
        h.remove()
    order = watch(model)  # accumulator hooks: unit by unit, fired by autograd
    opt.zero_grad()
    out = model(*inputs)
    assert not is_pass(out)
    emulated_loss(out).backward()
    names = {id(p): name for name, p in model.named_parameters()}
    assert [names[id(p)] for p in ahead] == order



def test_plain_hooks_fire_from_the_one_node_each_groups_on_time_in_the_order_autograd_fires_them():
    """Python post-accumulate hooks that are not ready_aware (a user's) need each gradient at its own time: the
    one node queues the backward group by group and fires each group's hooks once its time is done (lazily:
    up to LAZY_S early), without autograd's node per group, and in the order the unit-by-unit backward fires
    them; the backward ends at the same deadline."""
    model, inputs, emu, acc, opt = emulated_resnet(0.0004)  # a 40 ms backward
    names = {id(p): name for name, p in model.named_parameters()}
    seen = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: seen.append((names[id(p)], time.perf_counter())))
               for p in model.parameters()]
    for _ in range(2):
        seen.clear()
        opt.zero_grad()
        out = model(*inputs)
        assert is_pass(out) and unit_nodes(out) == 0
        start = acc.clock.deadline  # the forward ran to its deadline: the backward starts there
        wakes = acc.clock.wakes
        emulated_loss(out).backward()
        assert len(seen) == len(names)
        # Not woken once per group: a lazy run sleeps only once LAZY_S is owed. (How often it does sleep depends on
        # how fast this host runs the groups' hooks: on a VM whose Python keeps no more than LAZY_S ahead of the
        # groups, never; the hooks' times below are what the test holds.)
        assert acc.clock.wakes - wakes < len(emu._groups)
        at = dict(seen)
        done = 0.0
        for group_s, params in emu._groups:
            done += group_s
            for p in params:  # not before its group's time, less the lazy run's LAZY_S
                assert at[names[id(p)]] >= start + done - LAZY_S - 1e-4
        assert acc.clock.deadline == pytest.approx(start + emu._pass_s[0], abs=2e-3)
    on_time = [name for name, _ in seen]
    for h in handles:
        h.remove()
    order = watch(model)
    opt.zero_grad()
    out = model(*inputs)
    assert not is_pass(out)
    emulated_loss(out).backward()
    assert on_time == order



def test_one_hook_that_is_not_ready_aware_makes_the_one_node_fire_them_all_on_time():
    model = build_model("cnn")
    inputs, _ = model_input("cnn", 4)
    emulate(model, "v100", inputs)
    params = list(model.parameters())
    fired = []
    for p in params:
        p.register_post_accumulate_grad_hook(ready_aware(lambda _: fired.append(accelerator.ready_at())))
    emulated_loss(model(*inputs)).backward()
    assert len(fired) == len(params) and all(r is not None for r in fired)  # ahead: each told its time
    fired.clear()
    handle = params[-1].register_post_accumulate_grad_hook(lambda _: fired.append("plain"))
    out = model(*inputs)
    assert is_pass(out)
    emulated_loss(out).backward()
    # On time: every gradient is ready as its hook runs (ready_at None), the plain one's among them.
    assert fired.count("plain") == 1 and fired.count(None) == len(params)
    handle.remove()
    assert is_pass(model(*inputs))



@pytest.mark.parametrize("hooks", [plain, watch], ids=["plain", "accumulator"])
def test_a_watched_backward_does_not_wait_for_its_end_the_optimizer_step_queues_after_it(hooks):
    """As a GPU's host launches the optimizer step before the backward ends: the last gradients' hooks fire
    within the lazy bound of their time, and the host goes on without sleeping to the pass's end; the step's
    work starts on the device when the pass ends. A pipeline stage's backward, which hands its input's gradient
    on, still ends on its deadline."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.zeros(2, 8)
    emulate(model, "v100", (x,), times=[(0.0001, 0.0003)] * 3)  # 0.9 ms of backward: less than LAZY_S
    acc = accelerator.active()
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    fired = hooks(model)
    for _ in range(3):
        opt.zero_grad()
        loss = emulated_loss(model(x))
        wakes, end = acc.clock.wakes, acc.clock.deadline + 0.0009
        loss.backward()
        assert acc.clock.wakes == wakes and len(fired) % 4 == 0 and fired
        assert acc.clock.deadline == pytest.approx(end, abs=2e-4)
        opt.step()
        assert acc.clock.deadline > end  # the update is queued after the pass
    stage = torch.zeros(2, 8, requires_grad=True)  # a pipeline stage's received activation
    emulated_loss(model(stage)).backward()
    assert acc.clock.deadline <= time.perf_counter() and stage.grad is not None



@pytest.mark.parametrize("hooks", [plain, watch], ids=["plain", "accumulator"])
def test_a_watched_backward_wakes_ahead_of_its_end_for_the_hosts_last_work(hooks, monkeypatch):
    """A longer pass sleeps, but its last sleep ends LAZY_AHEAD before the pass does, so that the last hooks
    and the optimizer step's launch (cold Python, after a sleep) overlap the device's last work."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.zeros(2, 8)
    emulate(model, "v100", (x,), times=[(0.0001, 0.02)] * 3)  # 60 ms of backward: a sleep even on a busy host
    acc = accelerator.active()
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    hooks(model)
    # The lead the clock chose is deadline - now - left, `now` read inside run(): between run()'s entry and the
    # sleep. So it lies in [deadline - (slept_at + left), the same + (slept_at - entered)]: a preemption on a busy
    # host widens the interval, it cannot move it off LAZY_AHEAD.
    wakes, entered = [], []
    real_run, real_sleep = clock_module.Clock.run, clock_module.Clock._sleep
    monkeypatch.setattr(clock_module.Clock, "run",
                        lambda self, *a, **k: (entered.append(time.perf_counter()), real_run(self, *a, **k))[1])
    monkeypatch.setattr(clock_module.Clock, "_sleep",
                        lambda self, left: (wakes.append((time.perf_counter(), left, entered[-1] if entered else None)),
                                            real_sleep(self, left)))
    for _ in range(2):
        opt.zero_grad()
        loss = emulated_loss(model(x))
        wakes.clear()
        loss.backward()
        assert wakes and wakes[-1][2] is not None
        slept_at, left, since = wakes[-1]
        low = acc.clock.deadline - (slept_at + left)
        assert low - 1e-4 <= LAZY_AHEAD <= low + (slept_at - since) + 1e-4, (low, slept_at - since)
        opt.step()
