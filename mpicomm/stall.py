"""Waiting with a deadline: back off while polling, report a stall, and give up with a StallError."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

ENV_WARNING = "MPITRAIN_STALL_WARNING"
ENV_TIMEOUT = "MPITRAIN_STALL_TIMEOUT"


class StallError(TimeoutError):
    """A wait outlived its deadline; the message says what was missing (which ranks, which slices)."""


def _env_seconds(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("none", "inf", "0"):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${name} must be a number of seconds (or none), got {raw!r}") from None
    if value < 0:
        raise ValueError(f"${name} must be >= 0, got {value}")
    return value


@dataclass(frozen=True)
class StallPolicy:
    """How long a blocking wait may take, like Horovod's stall inspector.

    warn_after: seconds before the first stall report on stderr (then one
    every warn_after seconds); timeout: seconds before StallError is raised
    (None: wait for ever, reporting). Defaults: $MPITRAIN_STALL_WARNING (60)
    and $MPITRAIN_STALL_TIMEOUT (600; "none" disables it).
    """

    warn_after: float | None = 60.0
    timeout: float | None = 600.0

    @classmethod
    def from_env(cls) -> "StallPolicy":
        return cls(_env_seconds(ENV_WARNING, 60.0), _env_seconds(ENV_TIMEOUT, 600.0))

    def __post_init__(self):
        for name in ("warn_after", "timeout"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"StallPolicy.{name} must be a positive number of seconds or None, got {v!r}")


# By default a wait first polls with a yield of the core between polls (SPIN_SECONDS), then
# sleeps doubling up to MAX_SLEEP: a short wait costs no latency, a long one no core. The yield
# matters where ranks share cores: a rank spinning without it starved the others (a 4-rank
# Iallreduce on 2 cores took 5.3 ms instead of 36 us; sleeping 10 us instead of yielding, 265
# us). Spinning longer than ~1 ms took compute time from ranks that were still working (a 5 ms
# window cost the demo 15 % of its throughput). But MPI moves data only while someone calls it:
# a thread that drives a large transfer alone must never sleep (spin=DRIVE; sleeping doubled a
# VGG-19 ring allreduce), and a thread that merely watches one a progress thread drives should
# poll rarely (spin=WATCH), or it contends with that thread for MPI's lock.
SPIN_SECONDS = 1e-3
DRIVE, WATCH = float("inf"), 0.0
MIN_SLEEP, MAX_SLEEP = 10e-6, 1e-3
_job_check: Callable[[], None] | None = None  # raises when the job is over (set by mpicomm.failstop)


def set_job_check(check: Callable[[], None] | None) -> None:
    """Every wait calls `check()` between polls, as it calls its own interrupt (None: no such check)."""
    global _job_check
    _job_check = check


def wait_until(done: Callable[[], bool], *, what: str, report: Callable[[], str] = lambda: "",
               policy: StallPolicy | None = None, who: str = "", blocking: bool = False,
               interrupt: Callable[[], None] | None = None, spin: float = SPIN_SECONDS) -> None:
    """Poll `done()` until it returns True; print stall reports; raise StallError past the deadline.

    `what` names the wait ("p3 slices of parameter fc1.weight"); `report()`
    says what is missing (called only when a report is due). blocking: done()
    itself blocks for a short while (a condition variable), so no sleeping here.
    interrupt(): called between polls; it raises to abandon the wait (another
    rank's failure beacon). spin: seconds of yielding polls before sleeping
    ones (DRIVE: never sleep; WATCH: sleep from the start). The job-wide check
    (mpicomm.failstop: any rank of the job that stopped) is called too.
    """
    if done():
        return
    policy = policy or StallPolicy.from_env()
    start = time.monotonic()
    try:
        _wait_loop(done, what, report, policy, who, blocking, interrupt, spin, start)
    finally:
        _blocked.seconds = blocked_seconds() + time.monotonic() - start


# Seconds each thread has spent in wait_until's loop (blocked on other ranks): an emulated accelerator
# (runtime.emulate) lets host work overlap its queue, but not a wait for data.
_blocked = threading.local()


def blocked_seconds() -> float:
    """Seconds this thread has waited in wait_until so far."""
    return getattr(_blocked, "seconds", 0.0)


def _wait_loop(done, what, report, policy, who, blocking, interrupt, spin, start) -> None:
    next_warning = policy.warn_after
    polls, sleep, spinning = 0, MIN_SLEEP, spin > 0
    while not done():
        if interrupt is not None:
            interrupt()
        if _job_check is not None:
            _job_check()
        polls += 1
        if not blocking:
            if spinning:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(MAX_SLEEP, sleep * 2)
            if polls % 64:
                continue  # the clock is read every 64 polls only
        waited = time.monotonic() - start
        spinning = waited < spin
        if policy.timeout is not None and waited >= policy.timeout:
            raise StallError(f"{who}{what}: nothing after {waited:.0f} s (stall timeout {policy.timeout:g} s, "
                             f"${ENV_TIMEOUT}); {report()}")
        if next_warning is not None and waited >= next_warning:
            print(f"[mpitrain] {who}stall: {what} not done after {waited:.0f} s; {report()}", file=sys.stderr,
                  flush=True)
            next_warning += policy.warn_after
