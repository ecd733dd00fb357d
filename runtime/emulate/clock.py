"""The accelerator's clock: deadline-based waits that cost the host nothing and do not add up their overshoots."""

from __future__ import annotations

import ctypes
import time

from mpicomm.stall import blocked_seconds

__all__ = ["Clock", "set_timer_slack"]

_PR_SET_TIMERSLACK = 29


def set_timer_slack(ns: int = 1) -> bool:
    """This thread's timer slack (Linux prctl): the kernel's default 50 us adds to every sleep's overshoot."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class Clock:
    """One stream's timeline (one per thread): work queued on it ends at a deadline, one after the other.

    run(seconds) queues `seconds` of work and sleeps until it is done (time.sleep sleeps to an absolute
    deadline on Linux, with the timer slack at 1 ns: tens of microseconds late, not 90-290 us).

    When the work starts: a GPU's host launches ahead of its queue, so the host's own work between two
    pieces of work (Python, autograd, a strategy's hooks) does not delay the device, while a wait for other
    ranks (mpicomm.stall.wait_until: a gate on a parameter, say) does. Within a pass the next work starts
    at the last deadline plus the time the host spent blocked since; begin() starts a pass (a forward, an
    optimizer step) at the current time, less the host work given to absorb() (work that is the device's
    in reality). A sleep's overshoot never carries into the next deadline, so a step of many layers
    ends within one overshoot of its modelled total.
    """

    def __init__(self):
        self.deadline = 0.0
        self.busy = 0.0  # seconds of modelled work run so far
        self.waited = 0.0  # seconds this thread slept for it
        self.idle = 0.0  # seconds the device waited for the host (a pass's start, a blocked host)
        self._fresh = True  # the next run starts a pass
        self._absorbed = 0.0
        self._blocked_at = 0.0  # blocked_seconds() when the last run returned
        self._slack = False

    def begin(self) -> None:
        """The next work starts a pass: from now, not from the last deadline."""
        self._fresh = True

    def absorb(self, seconds: float) -> None:
        """Host work that is the device's in reality (zeroing gradient buffers in host memory): it does not
        delay the start of the next pass."""
        self._absorbed += seconds

    def run(self, seconds: float) -> None:
        """Queue `seconds` of modelled work and wait until it is done."""
        if seconds <= 0:
            return
        if not self._slack:
            self._slack = set_timer_slack(1) or True
        now = time.perf_counter()
        blocked = blocked_seconds()
        if self._fresh:
            start = max(self.deadline, now - self._absorbed)
            self._fresh, self._absorbed = False, 0.0
        else:
            start = self.deadline + (blocked - self._blocked_at)
        self.idle += max(0.0, start - self.deadline) if self.deadline else 0.0
        self.deadline = start + seconds
        self.busy += seconds
        left = self.deadline - now
        if left > 0:
            time.sleep(left)
            self.waited += left
        self._blocked_at = blocked
