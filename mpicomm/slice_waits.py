"""The training thread's side of p3's exchange (mpicomm.sliced_ps): waiting for tensors, and what a stall names."""

from __future__ import annotations

from .stall import StallPolicy, wait_until

__all__ = ["SliceWaits"]


class SliceWaits:
    """Mixed into SlicedExchange: its training thread blocks here until tensors hold their averages; the progress
    thread's poll wakes it (`_cond`) and its failure reaches it (`fail`)."""

    def fail(self, error: BaseException) -> None:
        """The progress thread's poll raised: wake every waiter with the error."""
        with self._lock:
            self.error = error
            self._cond.notify_all()

    def wait(self, tensors, policy: StallPolicy | None = None, interrupt=None) -> None:
        """Block until these tensors hold the averaged gradient; a stall report names the missing slices."""
        done = self.tensor_done
        if self.error is None and all(done[t] for t in tensors):
            return
        self._waiters += 1  # only the training thread changes these two; the progress thread reads them
        self._urgent = self._nearly_done(tensors)
        self.nudge()  # one poll now, whatever the urgency: what this layer needs may have arrived
        try:
            self._wait(tensors, policy, interrupt)
        finally:
            self._waiters -= 1

    def _nearly_done(self, tensors) -> bool:
        """At most `credit` slices of these tensors left: what remains is in flight, completions matter now."""
        left = self._slices_left
        return sum(left[t] for t in tensors) <= self.credit

    def _wait(self, tensors, policy, interrupt) -> None:
        done, lock, cond = self.tensor_done, self._lock, self._cond

        def finished() -> bool:
            if self.error is not None:
                raise self.error
            if all(done[t] for t in tensors):
                return True
            if not self._urgent and self._nearly_done(tensors):
                self._urgent = True
                self.nudge()
            with lock:  # woken at each completion; the timeout lets wait_until keep the deadline
                if not all(done[t] for t in tensors) and self.error is None:
                    cond.wait(0.05)
            return False
        wait_until(finished, what="p3 exchange", report=lambda: self.report(tensors), policy=policy,
                   who=f"rank {self.rank}: ", blocking=True, interrupt=interrupt)

    def report(self, tensors) -> str:
        """What the slices of these tensors are still waiting for."""
        plan, lines = self.plan, []
        for t in tensors:
            pending = [s for s in plan.slices_of[t] if not self._slice_finished[s]]
            if not pending:
                continue
            s = pending[0]
            if self._tensors_left[s]:
                waits = "this rank's own gradients (its backward has not produced them)"
            elif s in self._arrived and self._arrived[s] < len(self.sources[s]):
                waits = f"pushes from rank(s) {[p for p, got in zip(self.sources[s], self._got[s]) if not got]}"
            elif self.upstream[s] is not None and self._results_left[s] == len(self.downstream[s]):  # none out
                waits = (f"the average from its {'owner' if self.upstream[s] == plan.owner(s) else 'aggregator'}, "
                         f"rank {self.upstream[s]}")
            else:
                waits = f"sending its average ({self._results_left[s]} peers left)"
            lines.append(f"{self.names[t]} ({len(pending)} slices left, e.g. slice {s} waits for {waits})")
        return "; ".join(lines[:6]) or "nothing (finishing)"
