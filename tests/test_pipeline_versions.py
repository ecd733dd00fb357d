"""Weight versions without MPI: parameters sharing one storage (an LSTM flattened as cuDNN does) in every mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from runtime.pipeline import schedule, version_difference
from runtime.pipeline.versions import WeightVersions
from runtime.workloads.sequential import LSTMLayer

torch.set_num_threads(1)


def flatten_like_cudnn(weights) -> torch.Tensor:
    """Re-point parameters into one flat buffer with set_(), as nn.LSTM's flatten_parameters() does on CUDA."""
    buf = torch.cat([w.detach().reshape(-1) for w in weights])
    offset = 0
    with torch.no_grad():
        for w in weights:
            w.set_(buf.untyped_storage(), offset, w.shape, w.stride())
            offset += w.numel()
    return buf


def flatten_lstms(model: nn.Module) -> int:
    """Every nn.LSTM in `model` flattened into a buffer of its own; how many."""
    lstms = [m for m in model.modules() if isinstance(m, nn.LSTM)]
    for m in lstms:
        flatten_like_cudnn(m._flat_weights)
    return len(lstms)


class _WholeBuffer(torch.autograd.Function):
    """x @ w.t() + b that saves the whole buffer w and b live in and reads w back out of it (as cuDNN's RNN does)."""

    @staticmethod
    def forward(ctx, x, w, b, whole):
        ctx.save_for_backward(x, whole)
        ctx.where = (w.size(), w.stride(), w.storage_offset())
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, whole = ctx.saved_tensors
        w = whole.as_strided(*ctx.where)
        rows = g.reshape(-1, g.shape[-1])
        return g @ w, rows.t() @ x.reshape(-1, x.shape[-1]), rows.sum(0), None


class FlatLinear(nn.Linear):
    """A Linear whose weight and bias share one storage when flattened; the backward reads the whole buffer."""

    def forward(self, x):
        if self.weight.untyped_storage().data_ptr() != self.bias.untyped_storage().data_ptr():
            return super().forward(x)
        whole = torch.empty(0, dtype=self.weight.dtype).set_(self.weight.untyped_storage())
        return _WholeBuffer.apply(x, self.weight, self.bias, whole)


def model(flat: bool) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(FlatLinear(6, 8), nn.Tanh(), LSTMLayer(8, 8), LSTMLayer(8, 8), nn.Linear(8, 3))
    if flat:
        flatten_like_cudnn([m[0].weight, m[0].bias])
        assert flatten_lstms(m) == 2
    return m


def run_window(net: nn.Module, mode: str, variant: str = "paper", stages: int = 3, micro: int = 6):
    """Stage 0 of `stages` (stages micro-batches in flight) run as the engine does, its inputs requiring grad
    (as a later stage's do: every weight is saved); (parameters after, input gradients per micro-batch)."""
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    shifts = version_difference(0, stages, variant) if mode == "spectrain" else (0, 0)
    in_flight = schedule.warmup(0, stages) + 1
    versions = WeightVersions(params, mode, in_flight, opt, shifts, once=variant == "once", divisor=micro)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 5, 6, generator=g) for _ in range(micro)]
    grads = [torch.randn(2, 5, 3, generator=g) for _ in range(micro)]
    held, input_grads = {}, {}
    ops = list(schedule.step_ops(0, stages, 0, micro, 0)) + list(schedule.drain_ops(0, stages, micro, 0))
    for op, i in ops:
        if op == schedule.FORWARD:
            x = xs[i].clone().requires_grad_()
            with versions.forward(i % in_flight, i):
                held[i] = (x, net(x))
        else:
            x, out = held.pop(i)
            with versions.backward(i % in_flight, i):
                out.backward(grads[i])
            input_grads[i] = x.grad
            with versions.applied_lr():
                opt.step()
                opt.zero_grad()
            versions.updates += 1
    return [p.detach().clone() for p in params], [input_grads[i] for i in range(micro)], versions


@pytest.mark.parametrize("mode,variant", [("vanilla", "paper"), ("stash", "paper"), ("spectrain", "paper"),
                                          ("spectrain", "once")])
def test_weights_sharing_one_storage_train_as_the_unflattened_model_does(mode, variant):
    plain_params, plain_grads, _ = run_window(model(False), mode, variant)
    flat = model(True)
    flat_params, flat_grads, versions = run_window(flat, mode, variant)
    assert len(versions.storages.blocks) == 1 + 2 + 2  # the Linear's and each LSTM's weights share one; the head 2
    for a, b in zip(plain_params + plain_grads, flat_params + flat_grads):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    # Still one buffer per flattened module: no version was swapped in by re-pointing a weight elsewhere.
    lstm = flat[2].lstm
    assert len({w.untyped_storage().data_ptr() for w in lstm._flat_weights}) == 1
    if mode == "stash":  # per micro-batch in flight a copy of each storage saved from (the head's bias is not)
        held = [t for row in versions._stash for t in row if t is not None]
        assert len(held) == 3 * 4 and all(t.dim() == 1 for t in held)


def test_the_modes_differ_on_this_window():
    """The comparison above can fail: stash and vanilla really compute with other weights here."""
    vanilla, _, _ = run_window(model(True), "vanilla")
    stash, _, _ = run_window(model(True), "stash")
    assert max((a - b).abs().max().item() for a, b in zip(vanilla, stash)) > 1e-4


def test_a_stashed_version_holds_exactly_the_forwards_weights_and_leaves_the_live_ones_alone():
    net = model(True)
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    versions = WeightVersions(params, "stash", 2, opt)
    before = [p.detach().clone() for p in params]
    x = torch.randn(2, 5, 6, requires_grad=True)
    with versions.forward(0, 0):
        out = net(x)
    with torch.no_grad():
        for p in params:
            p.add_(1.0)  # an update while micro-batch 0 is in flight
    lives = [p.detach().clone() for p in params]
    with versions.backward(0, 0):
        out.sum().backward()
    assert all(torch.equal(p.detach(), live) for p, live in zip(params, lives))  # no neighbour clobbered
    copies = versions._stash[0]
    for i, p in enumerate(params):
        b = versions.storages.of[i]
        if copies[b] is not None:
            assert torch.equal(versions.storages.view(copies[b], p), before[i])


def test_parameters_over_the_same_elements_are_refused_with_their_numbers():
    w = nn.Parameter(torch.randn(4, 3))
    alias = nn.Parameter(torch.empty(0))
    with torch.no_grad():
        alias.set_(w.untyped_storage(), 3, (6,), (1,))
    with pytest.raises(ValueError, match="parameters #0 and #1 overlap in memory"):
        WeightVersions([w, alias], "stash", 2, torch.optim.SGD([w, alias], lr=0.1))
