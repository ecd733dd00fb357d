"""Error feedback for top-k sparsification: what a step did not send is added to the next step's gradient."""

from __future__ import annotations

from typing import Callable

import torch

from .selection import check_density, k_for_density

TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


class DensitySchedule:
    """Fraction of entries to send at each step (1.0: dense).

    `warmup_steps` dense steps first; then, DGC-style, the density falls
    exponentially from `start` to `density` over `ramp_steps` steps, so the
    model is not hit by full sparsity while its gradients are still large
    and changing fast.
    """

    def __init__(self, density: float, warmup_steps: int = 0, ramp_steps: int = 0, start: float = 0.25):
        self.density = check_density(density)
        self.start = max(check_density(start, "start density"), self.density)
        if warmup_steps < 0 or ramp_steps < 0:
            raise ValueError(f"warm-up and ramp steps must be >= 0, got {warmup_steps} and {ramp_steps}")
        self.warmup_steps, self.ramp_steps = int(warmup_steps), int(ramp_steps)

    def dense(self, step: int) -> bool:
        """Step numbers count from 0."""
        return step < self.warmup_steps

    def __call__(self, step: int) -> float:
        if self.dense(step):
            return 1.0
        t = step - self.warmup_steps
        if t >= self.ramp_steps:
            return self.density
        # Geometric interpolation: equal ratios per step from start to the target.
        return self.start * (self.density / self.start) ** (t / self.ramp_steps)

    def describe(self) -> str:
        return f"density={self.density} warmup={self.warmup_steps} ramp={self.ramp_steps} start={self.start}"


class ErrorFeedback:
    """Per-key residuals: select from gradient + residual, keep what was not selected for next time.

    Invariant (tested): over any run, everything selected plus the current
    residual equals the sum of every gradient given, per key. With
    `enabled=False` it is plain top-k (the unsent part is dropped).
    """

    def __init__(self, topk: TopK, enabled: bool = True):
        self.topk, self.enabled = topk, enabled
        self.residuals: dict = {}

    def select(self, key, x: torch.Tensor, density: float) -> tuple[torch.Tensor, torch.Tensor]:
        k = k_for_density(x.numel(), density)
        if not self.enabled:
            return self.topk(x, k)
        acc = self.residuals.get(key)
        if acc is None or acc.shape != x.shape or acc.dtype != x.dtype:
            acc = self.residuals[key] = torch.zeros_like(x)
        elif acc.device != x.device:  # loaded from a checkpoint (CPU): it lives beside the gradients from now
            acc = self.residuals[key] = acc.to(x.device)
        acc.add_(x)
        values, indices = self.topk(acc, k)
        values = values.clone()  # may be a view into the accumulator, which is cleared next
        acc.index_fill_(0, indices.long(), 0)
        return values, indices

    def residual(self, key) -> torch.Tensor | None:
        return self.residuals.get(key)

    def state_dict(self) -> dict:
        """The residuals as CPU tensors (copies), wherever they live."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict) -> None:
        self.residuals = {k: v.clone() for k, v in state.items()}
