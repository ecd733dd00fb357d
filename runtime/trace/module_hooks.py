"""Forward and backward spans per layer on a Timeline, through module hooks."""

from __future__ import annotations

import warnings

import torch

# The first layer's inputs need no gradient, so its full backward hook fires on outputs only;
# torch warns about exactly that, which is what we want here.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")


def instrument(model: torch.nn.Module, timeline) -> list:
    """Record "forward NAME" and "backward NAME" for every module that owns parameters; returns the hook handles."""
    handles = []
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        label = name or type(module).__name__
        open_fwd, open_bwd = [], []

        def fwd_pre(mod, inputs, label=label, stack=open_fwd):
            stack.append(timeline.begin(f"forward {label}", "compute", track="main"))

        def fwd_post(mod, inputs, output, stack=open_fwd):
            if stack:
                timeline.end(stack.pop())

        def bwd_pre(mod, grad_output, label=label, stack=open_bwd):
            stack.append(timeline.begin(f"backward {label}", "compute", track="main"))

        def bwd_post(mod, grad_input, grad_output, stack=open_bwd):
            if stack:
                timeline.end(stack.pop())

        handles += [module.register_forward_pre_hook(fwd_pre), module.register_forward_hook(fwd_post),
                    module.register_full_backward_pre_hook(bwd_pre), module.register_full_backward_hook(bwd_post)]
    return handles
