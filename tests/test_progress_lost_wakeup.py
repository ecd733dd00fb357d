"""A wake-up lost to a ^C: the progress thread's condition after a KeyboardInterrupt cut a notify() short."""

from __future__ import annotations

import threading
import time

import pytest

from mpicomm.progress import ProgressThread, Task

WAIT = 30.0  # seconds: only a hang-detector, never a measured time


class Once(Task):
    def poll(self) -> bool:
        return True


def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {WAIT} s"
        time.sleep(1e-3)


@pytest.mark.parametrize("end", ["stop", "abort"])
def test_a_wakeup_lost_to_a_ctrl_c_delays_the_thread_but_never_hangs_it(end):
    """A notify() that a KeyboardInterrupt cuts short after it woke the idle thread leaves that thread's wake-up
    lock queued, locked again by the thread (CPython's Condition; gh-92530 mended only a lock left released): the
    next notify() releases it, not the thread's new one. Built here as the interrupt leaves it (a caught ^C under
    wfbp hung in close() so): a task submitted next is still polled, and stop() and abort() still end the thread."""
    def lose_a_wakeup():
        until(lambda: thread._cv._waiters, "the idle thread's wait")
        with thread._cv:
            stale = threading.Lock()
            stale.acquire()
            thread._cv._waiters.appendleft(stale)

    thread = ProgressThread("test-lost-wakeup")
    lose_a_wakeup()
    thread.submit(Once()).wait(WAIT)
    lose_a_wakeup()
    ending = threading.Thread(target=getattr(thread, end), daemon=True)
    ending.start()
    ending.join(WAIT)
    assert not ending.is_alive() and not thread._thread.is_alive(), f"{end}() waited for ever"
