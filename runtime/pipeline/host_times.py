"""Host seconds of a stage's forwards, backwards and updates beyond its emulated device's sleeps (simulator draws)."""

from __future__ import annotations

import time
from contextlib import contextmanager

__all__ = ["OpTimes", "OPS", "SAMPLES", "snapshot"]

OPS = ("F", "B", "U")
SAMPLES = 10_000  # host times kept per kind until cleared (a long run keeps its first ones): ops, sends


def snapshot(seconds: dict[str, list[float]], clear: bool) -> dict[str, list[float]]:
    """A copy of each kind's host times; clear: empty them (a benchmark's timed window starts anew)."""
    out = {k: list(v) for k, v in seconds.items()}
    if clear:
        for v in seconds.values():
            v.clear()
    return out


class OpTimes:
    """Each op's host time: its wall time less what the thread slept for its emulated device's work.

    An emulated device's work costs the host nothing (runtime.emulate.clock): a big stage's ops are the
    device's time, and the host's Python (autograd, hooks, the emulator's bookkeeping) runs while it
    sleeps. A stage of one small layer is the host's: its device time is a fraction of a millisecond,
    its Python is not. The simulator models the device; these are what it takes the longer of.
    On a real device or the CPU nothing is slept for, and an op's host time is its wall time.
    """

    def __init__(self, timeline=None, clock=None):
        self.timeline = timeline
        self._clock = clock  # a callable returning the thread's emulated Clock, or None (runtime.emulate.active)
        self.seconds: dict[str, list[float]] = {k: [] for k in OPS}

    @contextmanager
    def op(self, kind: str, name: str, cat: str):
        """Time one op (its timeline span too, on the compute track); an op that raises is not counted."""
        span = self.timeline.begin(name, cat, track="compute") if self.timeline else None
        clock = self._clock() if self._clock else None
        slept, start = (clock.waited if clock else 0.0), time.perf_counter()
        yield
        took = time.perf_counter() - start - ((clock.waited - slept) if clock else 0.0)
        if len(self.seconds[kind]) < SAMPLES:
            self.seconds[kind].append(max(0.0, took))
        if span is not None:
            self.timeline.end(span)

    def times(self, clear: bool = False) -> dict[str, list[float]]:
        """The host seconds of each op since the last clear, by kind ("F", "B", "U"); clear: start anew."""
        return snapshot(self.seconds, clear)
