"""What a ^C can leave the progress thread: a wake-up lost (a notify() cut short), a lock held for ever."""

from __future__ import annotations

import threading
import time

import pytest

from mpicomm.failstop import PICKUP
from mpicomm.progress import ABORT_JOIN, ProgressThread, Task

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


def test_abort_does_not_wait_for_ever_on_a_thread_blocked_by_a_lock_a_ctrl_c_left_held():
    """A KeyboardInterrupt can land in a Python-level __enter__ (a Condition's, an Event's) after it took the lock
    and before the with-block began (gh-74174): the training thread holds that lock for ever. A task the thread
    polls that needs it blocks the thread; abort(), on the error path, gives up on it after ABORT_JOIN and says so,
    instead of waiting until the fail-stop watcher ends the rank (CI, 81e3420: a ^C under p3, rank 1 "blocked in
    threading.py (_wait_for_tstate_lock), where no wait looks")."""
    held, polled = threading.Lock(), threading.Event()

    class NeedsTheLock(Task):
        def poll(self) -> bool:
            polled.set()
            with held:
                return True

    held.acquire()  # as the ^C left it
    thread = ProgressThread("test-held-lock")
    try:
        thread.submit(NeedsTheLock())
        until(polled.is_set, "the poll")
        result = []
        ending = threading.Thread(target=lambda: result.append(thread.abort()), daemon=True)
        ending.start()
        ending.join(WAIT)
        assert not ending.is_alive(), "abort() waited for ever"
        assert result == [False] and thread._thread.is_alive()  # left behind, and said so
    finally:
        held.release()
    thread._thread.join(WAIT)  # the lock free again, it ends: nothing was pending any more
    assert not thread._thread.is_alive()
    assert ABORT_JOIN < PICKUP  # given up on before the fail-stop watcher would end the rank
