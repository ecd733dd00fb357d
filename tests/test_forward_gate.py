"""P3's forward gate: which module's forward waits for which parameters, and in which priority order."""

from __future__ import annotations

import torch
import torch.nn as nn

from runtime.p3.forward_gate import ForwardGate


class Net(nn.Module):
    """Registered in another order than it runs; attention reads out_proj without running it; `unused` never runs."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(4, 4)
        self.attn = nn.MultiheadAttention(4, 2)
        self.early = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))  # held by the root itself

    def forward(self, x):
        h = self.early(x) * self.scale
        h, _ = self.attn(h, h, h)
        return self.late(h)


# model.parameters() order: the root's own first, then children in registration order.
NAMES = ["scale", "late.weight", "late.bias", "attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight",
         "attn.out_proj.bias", "early.weight", "early.bias", "unused.weight", "unused.bias"]
# First-run order: root 0, early 1, attn 2, late 3; unused's parameters wait at the root, priority -1.
PRIORITY = [0, 3, 3, 2, 2, 2, 2, 1, 1, -1, -1]
ENTERED = [("", [0, 9, 10]), ("early", [7, 8]), ("attn", [3, 4, 5, 6]), ("late", [1, 2])]


def x():
    return torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(0))  # (sequence, batch, features)


def gated(model, params=None):
    """A gate and the log of its on_enter calls, each with the module that was entering."""
    entering, calls = [], []
    for name, module in model.named_modules():  # prepended: runs before the gate's own pre-hook
        module.register_forward_pre_hook(lambda m, a, name=name: entering.append(name), prepend=True)
    params = list(model.parameters()) if params is None else params
    gate = ForwardGate(model, params, lambda owed: calls.append((entering[-1], list(owed))))
    return gate, calls


def test_parameter_order_of_the_model_is_as_the_tables_assume():
    assert [n for n, _ in Net().named_parameters()] == NAMES


def test_before_freeze_the_hooks_only_record_the_first_run_order():
    """A gate that already called on_enter while learning would make the first steps wait on nothing."""
    model = Net()
    gate, calls = gated(model)
    for _ in range(3):
        model(x())
    assert calls == [] and gate.gate is None
    positions = {name: pos for pos, name in enumerate(gate.names)}
    assert gate.order == [positions[n] for n in ("", "early", "attn", "late")]  # each once, by first run


def test_after_freeze_each_module_enters_with_exactly_the_parameters_it_gates():
    """Each call comes from the gating module with its parameters and no others, every forward pass.

    Catches: gating by holder only (out_proj's parameters would never be released, since out_proj never
    runs), gating unused parameters at a module other than the root, releasing a parameter twice per pass.
    """
    model = Net()
    gate, calls = gated(model)
    model(x())
    assert gate.freeze() == PRIORITY
    for _ in range(2):
        calls.clear()
        model(x())
        assert calls == ENTERED
    released = sorted(i for _, owed in ENTERED for i in owed)
    assert released == list(range(len(NAMES)))  # every parameter waits somewhere, once


def test_attention_out_proj_is_gated_by_the_attention_module():
    """nn.MultiheadAttention reads out_proj.weight directly: its module's hook never fires, its parent's does."""
    model = Net()
    gate, calls = gated(model)
    model(x())
    priority = gate.freeze()
    out_proj = [NAMES.index("attn.out_proj.weight"), NAMES.index("attn.out_proj.bias")]
    assert [priority[i] for i in out_proj] == [priority[NAMES.index("attn.in_proj_weight")]] * 2
    calls.clear()
    model(x())
    assert [name for name, owed in calls if set(out_proj) <= set(owed)] == ["attn"]


def test_parameters_of_a_module_that_never_ran_wait_at_the_root_with_priority_minus_one():
    """Released first, before anything runs: a gate that left them out would never apply their updates."""
    model = Net()
    gate, calls = gated(model)
    model(x())
    priority = gate.freeze()
    unused = [NAMES.index("unused.weight"), NAMES.index("unused.bias")]
    assert [priority[i] for i in unused] == [-1, -1]
    assert all(p >= 0 for i, p in enumerate(priority) if i not in unused)
    assert all(i in gate.gate[0] for i in unused)


def test_priorities_follow_first_run_order_not_registration_order():
    """`late` is registered before `early` but runs after it: priority by module position would invert them."""
    model = Net()
    gate, _ = gated(model)
    model(x())
    priority = gate.freeze()
    early, attn, late = (priority[NAMES.index(n)] for n in ("early.weight", "attn.in_proj_weight", "late.weight"))
    assert 0 == priority[NAMES.index("scale")] < early < attn < late


def test_a_parameter_list_that_leaves_some_out_is_indexed_by_its_own_positions():
    """The gate reports positions in the list it was given (DistributedOptimizer's trainable parameters)."""
    model = Net()
    model.late.bias.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    gate, calls = gated(model, params)
    model(x())
    priority = gate.freeze()
    assert len(priority) == len(params) == len(NAMES) - 1
    calls.clear()
    model(x())
    assert calls[-1] == ("late", [NAMES.index("late.weight")])
    assert sorted(i for _, owed in calls for i in owed) == list(range(len(params)))


def test_remove_takes_every_hook_away():
    model = Net()
    gate = ForwardGate(model, list(model.parameters()), lambda owed: calls.append(owed))
    calls = []
    model(x())
    gate.freeze()
    gate.remove()
    assert gate.handles == []
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())
    model(x())
    assert calls == []
