"""Which layers of a model can send sufficient factors: plain nn.Linear layers whose weight only they own and train."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class FCLayer:
    """A fully connected layer y = x Wᵀ + b with W of shape N x M (out x in): its gradient is Σ δᵀ u."""

    name: str
    module: nn.Linear
    has_bias: bool  # a trainable bias (its gradient, Σ δ, travels with the factors)

    @property
    def M(self) -> int:
        return self.module.in_features

    @property
    def N(self) -> int:
        return self.module.out_features


def fc_layers(model: nn.Module) -> tuple[list[FCLayer], dict[str, str]]:
    """(eligible layers in model order, {name: why not} for Linear layers that must go through the dense path).

    Eligible: an nn.Linear whose forward is nn.Linear's own (a subclass with
    another forward, or MultiheadAttention's out_proj, whose weight is used
    without calling the module, has no factors to capture), whose weight is
    trainable and appears in no other module (a weight tied to an embedding
    collects gradients the factors do not describe).
    """
    owners: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    eligible, refused = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if type(module).forward is not nn.Linear.forward or _used_by_parent(model, name):
            refused[name] = "its weight is used without calling the layer (MultiheadAttention's out_proj)"
        elif not module.weight.requires_grad:
            if module.bias is not None and module.bias.requires_grad:
                refused[name] = "frozen weight (its trainable bias alone has no factors)"
        elif owners.get(id(module.weight), 0) > 1 or \
                (module.bias is not None and owners.get(id(module.bias), 0) > 1):
            refused[name] = "tied weight (shared with another module)"
        else:
            eligible.append(FCLayer(name, module, module.bias is not None and module.bias.requires_grad))
    return eligible, refused


def _used_by_parent(model: nn.Module, name: str) -> bool:
    """MultiheadAttention reads out_proj.weight directly in its functional forward."""
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return isinstance(parent, nn.MultiheadAttention)
