"""A diverged training loss (not finite, or exploding), found on a last stage and raised on every rank."""

from __future__ import annotations

import math

import torch

from mpicomm.failstop import PeerFailedError

from .checks import PipelineError

DIVERGE_FACTOR = 100.0


class DivergenceError(PipelineError, FloatingPointError):
    """The training loss diverged; raised on every rank with the last stage's words (the step and the loss)."""


# How another rank's DivergenceError reaches this one: its failure beacon, "rank R stopped with <Class>: <text>".
_HEARD = f"stopped with {DivergenceError.__name__}: "


class LossWatch:
    """Checks each micro-batch's loss on a last stage before its gradient is sent or applied: a diverged one never is.

    Diverged: not finite, or above `factor` times the first micro-batch's loss
    (the untrained model's; only when that is positive). factor None: only a
    non-finite loss stops training.
    """

    def __init__(self, factor: float | None, where: str):
        if factor is not None and not factor > 1:
            raise ValueError(f"diverge_factor must be > 1 or None, got {factor!r}")
        self.factor, self.where = factor, where
        self.reference: float | None = None
        self.computed: list[torch.Tensor] = []  # this step's micro-batch losses (on a GPU: pinned host copies)
        self.values: list[float] = []  # those read so far
        self.reads = 0  # device-to-host reads: the host waited for the device
        # On a GPU, the k-th loss of a step is copied into slot k as soon as it is computed, and the copy's event
        # recorded: a read then waits for that copy alone, not for the backward queued after it (a plain .item()
        # waits for everything on the stream). Made at the first step, reused after.
        self._slots: list[tuple[torch.Tensor, torch.cuda.Event]] = []

    def add(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss, just computed (on a GPU: its copy to the host queued behind it)."""
        loss = loss.detach()
        if not loss.is_cuda:
            self.computed.append(loss)
            return
        k = len(self.computed)
        if k == len(self._slots):
            self._slots.append((torch.empty((), dtype=loss.dtype, pin_memory=True),
                                torch.cuda.Event(blocking=True)))
        host, copied = self._slots[k]
        host.copy_(loss, non_blocking=True)
        copied.record(torch.cuda.current_stream(loss.device))
        self.computed.append(host)

    def new_step(self) -> None:
        self.computed, self.values = [], []

    def read(self, step: int) -> None:
        """Read the losses computed and not read yet (one copy for all) and check each."""
        new = self.computed[len(self.values):]
        if not new:
            return
        self.reads += 1
        if self._slots:  # the last one's copy was queued after the others' on the same stream
            self._slots[len(self.computed) - 1][1].synchronize()
        for v in (torch.stack(new).tolist() if len(new) > 1 else [float(new[0])]):
            self.values.append(v)
            self.check(v, step, len(self.values) - 1)

    def mean(self, step: int) -> float:
        self.read(step)
        return sum(self.values) / len(self.values)

    def check(self, loss: float, step: int, micro: int) -> None:
        at = f"training diverged at step {step} (micro-batch {micro}): loss {loss:.4g}"
        if not math.isfinite(loss):
            raise DivergenceError(f"{at} is not finite ({self.where}); lower the learning rate")
        if self.reference is None:
            self.reference = loss
        elif self.factor is not None and self.reference > 0 and loss > self.factor * self.reference:
            raise DivergenceError(f"{at} is over {self.factor:g} x the first micro-batch's {self.reference:.4g} "
                                  f"({self.where}); lower the learning rate")


def heard(exc: BaseException) -> BaseException:
    """The exception this rank raises for `exc`: another rank's divergence becomes a DivergenceError here too."""
    text = str(exc)
    if isinstance(exc, PeerFailedError) and _HEARD in text:
        return DivergenceError(text.split(_HEARD, 1)[1])
    return exc
