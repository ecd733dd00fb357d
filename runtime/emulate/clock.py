"""The accelerator's clock: deadline-based waits that cost the host nothing and do not add up their overshoots."""

from __future__ import annotations

import ctypes
import time

from mpicomm.stall import blocked_seconds

__all__ = ["Clock", "LAZY_AHEAD", "LAZY_S", "set_timer_slack"]

_PR_SET_TIMERSLACK = 29
# A lazy run sleeps only once this much work is owed: each wake-up costs the host 17-25 us here after 0.2-3 ms
# asleep, so a layer of 50 us would cost a third of its modelled time in wake-ups; owing up to 1 ms keeps them
# near 2 %. (Sleeping longer does not help: a wake-up after 10 ms costs ~60 us, its caches colder.)
LAZY_S = 1e-3
# How long before a watched pass's end its last wait wakes (run's ahead): the host's work after it, cold (the last
# hooks, autograd's return, the optimizer step's launch: 0.1-0.5 ms here), then overlaps the device's last work.
# Those hooks run early by at most LAZY_S, as any lazy run's may.
LAZY_AHEAD = LAZY_S


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
    ends within one overshoot of its modelled total. A lazy run (a layer inside a pass) returns without
    sleeping while less than LAZY_S is owed: the next run, or sync(), sleeps for both.
    """

    def __init__(self):
        self.deadline = 0.0
        self.busy = 0.0  # seconds of modelled work run so far
        self.waited = 0.0  # seconds this thread slept for it
        self.idle = 0.0  # seconds the device waited for the host (a pass's start, a blocked host)
        self._fresh = True  # the next run starts a pass
        self._absorbed = 0.0
        self._blocked_at = 0.0  # blocked_seconds() when the last run returned
        self._owed = 0.0  # work a lazy run left queued when it returned: a block shorter than that idles nothing
        self._slack = False
        self._begin_at: float | None = None
        self._not_before = 0.0  # the next work waits for another stream's until then (after)
        self.wakes = 0  # sleeps so far: each costs the host a wake-up (tens of microseconds of CPU on a VM)
        # While a backward that runs ahead fires a gradient's hooks: when that gradient is ready (accelerator.ready_at).
        self.ready_at: float | None = None

    def begin(self, at: float | None = None) -> None:
        """The next work starts a pass: from now (or from `at`, a perf_counter() time: the host queued it
        then and runs it later, as a forward does), not from the last deadline."""
        self._fresh, self._begin_at = True, at

    def after(self, at: float) -> None:
        """The next work queued on this stream starts no earlier than `at` (a perf_counter() time), the end of
        work on another stream that it depends on, as a CUDA stream waits on an event recorded on another (a
        copy back to the device on a side stream, before the update that reads it); the host does not wait."""
        self._not_before = max(self._not_before, at)

    def absorb(self, seconds: float) -> None:
        """Host work that is the device's in reality (zeroing gradient buffers in host memory, a DMA's copy):
        it does not delay the start of the next pass."""
        self._absorbed += seconds

    def run(self, seconds: float, lazy: bool = False, wait: bool = True, ahead: float = 0.0) -> None:
        """Queue `seconds` of modelled work and wait until it is done (lazy: or until less than LAZY_S is left;
        wait=False: not at all, as a GPU's host launches an optimizer step and goes on to the next forward,
        whose work starts when this ends: the next run, or sync(), waits for both). ahead (lazy, at most LAZY_S):
        a sleep wakes this long before the end, so that the host's own work after it (the hooks of a pass's
        last gradients, launching the optimizer step) overlaps the device's last work, as a GPU's host runs
        ahead of its device, instead of idling it."""
        if seconds <= 0:
            if not lazy and wait:
                self.sync()
            return
        if not self._slack:
            self._slack = set_timer_slack(1) or True
        now = time.perf_counter()
        blocked = blocked_seconds()
        if self._fresh:
            # Never before the last deadline, and the credit is spent here: a credit carried on would let the
            # device's timeline fall behind the host's clock and the next passes run in no time.
            start = max(self.deadline, (now if self._begin_at is None else self._begin_at) - self._absorbed)
            self._fresh, self._absorbed, self._begin_at = False, 0.0, None
        else:
            start = self.deadline + self._outlasted(blocked)
        if self._not_before:
            start, self._not_before = max(start, self._not_before), 0.0
        self.idle += max(0.0, start - self.deadline) if self.deadline else 0.0
        self.deadline = start + seconds
        self.busy += seconds
        self._blocked_at = blocked
        left = self.deadline - now
        self._owed = 0.0
        if not wait:
            self._owed = max(0.0, left)
        elif left > (LAZY_S if lazy else 0.0):
            self._sleep(left - ahead)
            self._owed = ahead
        elif left > 0:
            self._owed = left

    def sync(self) -> None:
        """Wait until the work queued so far is done (what lazy runs still owe)."""
        if self._owed > 0:
            blocked = blocked_seconds()
            idle = self._outlasted(blocked)
            self.deadline += idle
            self.idle += idle
            self._blocked_at, self._owed = blocked, 0.0
        if self._not_before:  # what the next work would wait for: synchronize waits for it too
            self.deadline, self._not_before = max(self.deadline, self._not_before), 0.0
        left = self.deadline - time.perf_counter()
        if left > 0:
            self._sleep(left)

    def _outlasted(self, blocked: float) -> float:
        """How long the device idled for the host's blocks since the last run: a block delays the work queued
        after it only by what it outlasted of the work still owed when the run returned."""
        return max(0.0, blocked - self._blocked_at - self._owed)

    def _sleep(self, left: float) -> None:
        time.sleep(left)
        self.waited += left
        self.wakes += 1
