"""Updates a deferred strategy (p3) owes parameters until just before their next use."""

from __future__ import annotations

import numpy as np

from .trace import span_of


class DeferredUpdates:
    """The owed set, the hyper-parameters of the step that owes it, and a zero_grad() that must wait for it.

    After a p3 step each used parameter is owed its update; the forward gate
    applies a layer's updates as the layer starts (waiting for its slices
    first), and whatever a forward pass skipped is applied before the next
    backward or step. A parameter keeps its averaged gradient until its
    update is applied, so zero_grad() zeroes the others at once and those
    only once applied.

    A model.zero_grad() after the step bypasses the wrapper; it drops no
    average either. Between step() and the update each .grad is a placeholder
    (GradientBuffers.park): set to None, or zeroed in place (set_to_none=
    False), it tells apply() to point .grad at the buffer again, update, then
    zero it; a tensor assigned to it is copied there after the update.

    A layer's updates also take along those of any later layer whose
    averages have already arrived (`averaged`): one optimizer call instead of
    several, which is what per-layer updates cost where the link is fast.
    """

    def __init__(self, wait, updater, buffers, timeline=None, averaged=None, landing=None):
        """wait(indices): the averaged gradients of these parameters are in .grad once it returns;
        averaged(): per parameter, whether that is already so (optional); landing(indices): those of them
        into whose .grad the previous step's average may still land (optional)."""
        self.wait, self.updater, self.buffers, self.timeline = wait, updater, buffers, timeline
        self.averaged, self.landing = averaged, landing
        self.owed = np.zeros(len(buffers.params), dtype=bool)
        self.hyper: list | None = None
        self._zero_requested = False
        self._zero_on_owe = False  # zero_grad() came before the step's agreement said what is owed

    @staticmethod
    def used_early(name: str, strategy: str, landing: bool = False) -> RuntimeError:
        """The error of a gradient that came before its parameter's owed update was applied (landing: before
        the previous step's average had landed in its .grad)."""
        what = ("the previous step's average had landed in its .grad" if landing
                else f"its deferred ({strategy}) update was applied")
        return RuntimeError(
            f"{name} got a gradient before {what}: a forward pass used it "
            "without running the module that held it in the first forward pass (a weight shared or read by "
            "another module). Call synchronize() before such forward passes, or use a strategy that updates in "
            "step() (wfbp)")

    def pending(self) -> bool:
        return bool(self.owed.any())

    def owe(self, mask: np.ndarray, hyper: list, fresh=()) -> None:
        """fresh: parameters whose gradient of the next step has begun already (a zero_grad() before it holds
        for the others)."""
        self.owed, self.hyper = mask.copy(), hyper
        # Owed nothing (no rank used them): their views back in .grad now, as a loop left them since the step.
        self._settle_grads(*self.buffers.unpark(np.flatnonzero(~self.owed)))
        if self._zero_on_owe:
            self._zero_on_owe = False
            idle = ~self.owed
            idle[list(fresh)] = False
            self.buffers.zero(np.flatnonzero(idle))
            self._zero_requested = self.pending()

    def apply(self, indices=None) -> None:
        """Wait for these parameters' averaged gradients (all owed ones when None), then update them.

        A module's gate (indices given) also waits for those it gates that are owed nothing but whose previous
        average, zero (no rank used them), is still landing: their gradients of this step must not
        accumulate in .grad before it has landed there.
        """
        if indices is None:
            owed, landing = np.flatnonzero(self.owed).tolist(), []
        else:
            owed = [i for i in indices if self.owed[i]]
            idle = [i for i in indices if not self.owed[i]] if self.landing is not None else ()
            landing = self.landing(idle) if idle else []
        if not owed:
            if landing:
                with span_of(self.timeline, f"wait {len(landing)} params landing", "sync", params=landing[:8]):
                    self.wait(landing)
            return
        if indices is not None and self.averaged is not None:
            ready = self.owed & self.averaged()
            ready[owed] = False
            owed += np.flatnonzero(ready).tolist()
        tl = self.timeline
        with span_of(tl, f"wait {len(owed)} params", "sync", params=owed[:8]):
            self.wait(owed + landing)
        # A loop that zeroed .grad since the step (model.zero_grad(), in place or not) zeroed a placeholder, not the
        # average: the update reads the average, and the gradient is zero after it, as that call asked.
        cleared, replaced = self.buffers.unpark(owed)
        self.updater.step(owed, self.hyper)
        self.owed[owed] = False
        if self._zero_requested:  # the wrapper's zero_grad() since the step: every one of them
            cleared = owed
            self._zero_requested = self.pending()
        self._settle_grads(cleared, replaced)

    def _settle_grads(self, cleared: list[int], replaced: dict) -> None:
        """What a loop did to parked gradients, done to their views: zeroed, or set to its own tensors."""
        if cleared:
            self.buffers.zero(cleared)
        if replaced:
            self.buffers.restore(replaced)

    def zero_grad(self, owed_known: bool = True) -> None:
        """owed_known=False: the step's agreement, which says what is owed (and kept), is not in yet: the
        zeroing waits for owe()."""
        if not owed_known:
            self._zero_on_owe = True
        elif self.pending():
            self._zero_requested = True
            self.buffers.zero(np.flatnonzero(~self.owed))
        else:
            self.buffers.zero()
