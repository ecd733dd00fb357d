"""A token bucket for messages that must not run ahead: `rate` bytes a second, `in_flight` at once."""

from __future__ import annotations

import time

__all__ = ["Pacer"]


class Pacer:
    """Admits a message while the bucket (filled at `rate` bytes a second, holding at most `burst`) has its bytes
    and fewer than `in_flight` admitted messages are still out; `peak`: the most that were out at once."""

    def __init__(self, rate: float, burst: float, in_flight: int = 1, clock=time.perf_counter):
        if not rate > 0 or not burst > 0 or in_flight < 1:
            raise ValueError(f"a pacer needs rate > 0, burst > 0 and in_flight >= 1, got {rate!r}, {burst!r}, "
                             f"{in_flight!r}")
        self.rate, self.burst, self.in_flight, self._clock = rate, burst, in_flight, clock
        self.out = self.peak = 0
        self._tokens, self._at = burst, clock()

    def admits(self, nbytes: int) -> bool:
        if self.out >= self.in_flight:
            return False
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        return self._tokens >= min(nbytes, self.burst)  # a message larger than the bucket waits for a full one

    def sent(self, nbytes: int) -> None:
        self.out += 1
        self.peak = max(self.peak, self.out)
        self._tokens -= nbytes

    def done(self) -> None:
        self.out -= 1

    def reset(self) -> None:
        """A step aborted or begun: nothing of ours is out (the bucket keeps its level)."""
        self.out = 0
