"""Parameters frozen when the optimizer was wrapped: one made trainable later is refused, never silently left out."""

from __future__ import annotations

__all__ = ["FrozenWatch", "ParametersChangedError"]


class ParametersChangedError(ValueError):
    """A parameter the wrapper left out (requires_grad=False at wrap) trains now: wrap again to include it."""


class FrozenWatch:
    """The parameters a DistributedOptimizer does not train, checked at each step() (a look at each flag).

    The wrapper's gradient buffers, hooks and the optimizer's groups are fixed when it wraps the model: a layer
    unfrozen later (gradual unfreezing in fine-tuning) would get gradients that no strategy sends and no update
    applies, on every rank alike, with no error.
    """

    def __init__(self, model):
        self.frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]

    def check(self) -> None:
        if not any(p.requires_grad for _, p in self.frozen):
            return
        woke = [n for n, p in self.frozen if p.requires_grad]
        raise ParametersChangedError(
            f"{', '.join(woke[:4])}{' ...' if len(woke) > 4 else ''}: frozen (requires_grad=False) when the optimizer "
            "was wrapped, trainable now: their gradients would never be averaged nor applied. close() the "
            "DistributedOptimizer and wrap the model again after changing which parameters train")
