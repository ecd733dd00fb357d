"""GradientBuffers' parking: what a loop does to .grad while a deferred step's averages land, read back per parameter."""

from __future__ import annotations

import torch
import torch.nn as nn

from runtime.grad_buffers import GradientBuffers


def parked_model():
    """A small model whose gradients are views of the buffers, holding 1, 2, 3 ... (an average landing), parked."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    params = list(model.parameters())
    buffers = GradientBuffers(params, [n for n, _ in model.named_parameters()])
    for k, view in enumerate(buffers.grads):
        view.fill_(k + 1.0)
    buffers.park()
    return model, params, buffers


def test_parked_gradients_are_zero_placeholders_and_the_views_keep_the_averages():
    model, params, buffers = parked_model()
    assert all(p.grad.is_sparse and p.grad.shape == p.shape and not p.grad.to_dense().any() for p in params)
    assert all(buffers.parked(i) and buffers.holds(i) for i in range(len(params)))
    cleared, replaced = buffers.unpark(range(len(params)))
    assert cleared == [] and replaced == {}
    assert all(p.grad is v and bool((v == k + 1).all()) for k, (p, v) in enumerate(zip(params, buffers.grads)))


def test_a_loop_zeroing_in_place_or_to_none_or_assigning_is_read_back_per_parameter():
    model, params, buffers = parked_model()
    params[0].grad.zero_()  # in place, one parameter
    params[1].grad = None
    mine = torch.full_like(params[2], 9.0)
    params[2].grad = mine
    cleared, replaced = buffers.unpark(range(len(params)))
    assert cleared == [0, 1] and list(replaced) == [2] and replaced[2] is mine
    assert all(bool((v == k + 1).all()) for k, v in enumerate(buffers.grads))  # the averages are untouched
    buffers.restore(replaced)
    assert bool((buffers.grads[2] == 9.0).all()) and params[2].grad is buffers.grads[2]

    model, params, buffers = parked_model()
    model.zero_grad(set_to_none=False)  # torch's foreach zero over every placeholder
    cleared, _ = buffers.unpark(range(len(params)))
    assert cleared == list(range(len(params)))
    assert all(bool((v == k + 1).all()) for k, v in enumerate(buffers.grads))


def test_a_gradient_arriving_while_parked_replaces_the_placeholder_and_reaches_the_hooks():
    """Autograd adds a dense gradient to a sparse .grad out of place: the post-accumulate hook (the optimizer's
    _on_grad, which names a parameter whose owed update was skipped) sees a dense gradient; the view is untouched."""
    model, params, buffers = parked_model()
    seen = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: seen.append(q.grad.is_sparse))
    model(torch.randn(5, 3)).sum().backward()
    assert seen == [False] * len(params)
    assert all(not p.grad.is_sparse and p.grad is not v for p, v in zip(params, buffers.grads))
    assert all(bool((v == k + 1).all()) for k, v in enumerate(buffers.grads))
    _, replaced = buffers.unpark(range(len(params)))
    assert sorted(replaced) == list(range(len(params)))


def test_new_buffers_take_over_parked_gradients_as_zeros():
    """A wrapper that failed mid-step may leave placeholders; a new one's buffers take them as zero gradients."""
    model, params, buffers = parked_model()
    fresh = GradientBuffers(params, [n for n, _ in model.named_parameters()])
    assert all(p.grad is v and not v.any() for p, v in zip(params, fresh.grads))
