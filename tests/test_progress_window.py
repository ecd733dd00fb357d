"""The progress thread's windows: tasks started in sequence, at most a window's size under way at once."""

from __future__ import annotations

import threading
import time

import pytest

from mpicomm.progress import ProgressThread, Window, WindowedTask
from test_progress_thread import WAIT, Countdown, until


@pytest.fixture
def pt():
    thread = ProgressThread("test-progress")
    yield thread
    thread.abort()  # never waits for a task a failed test left pending


def windowed(pt, window, seqs):
    """Submit a WindowedTask per sequence number in `seqs` (that order); each makes a held Countdown. Returns
    {seq: future}, {seq: the Countdown once made} and the order they were made in."""
    made, order = {}, []

    def maker(seq):
        def make():
            order.append(seq)
            made[seq] = Countdown(None)
            return made[seq]
        return make
    return {seq: pt.submit(WindowedTask(window, seq, maker(seq))) for seq in seqs}, made, order


def test_a_window_of_one_starts_its_tasks_in_sequence_whatever_order_they_were_submitted_in(pt):
    """Submitted 2, 0, 1: made 0, 1, 2, each only once the one before finished. A window that started them in
    submission order (what deadlocks two ranks that readied their buckets in different orders), or two at once,
    is caught. After the last one the sequence starts at 0 again."""
    window = Window(1, 3)
    futures, made, order = windowed(pt, window, [2, 0, 1])
    until(lambda: order == [0], "task 0 made")
    time.sleep(0.02)  # polls that must not make 1 or 2 while 0 is under way
    assert order == [0] and window.busy == 1
    for seq in (0, 1, 2):
        until(lambda: seq in made, f"task {seq} made")
        assert not futures[seq].done() and order == list(range(seq + 1))
        made[seq].release.set()
        futures[seq].wait(WAIT)
    assert order == [0, 1, 2] and (window.busy, window.next) == (0, 0)


def test_a_window_of_two_starts_the_next_task_as_soon_as_either_finishes(pt):
    """0 and 1 under way at once, 2 held; 1 finishing first lets 2 start while 0 is still under way."""
    window = Window(2, 3)
    futures, made, order = windowed(pt, window, [0, 1, 2])
    until(lambda: order == [0, 1], "tasks 0 and 1 made")
    time.sleep(0.02)
    assert order == [0, 1] and window.busy == 2
    made[1].release.set()
    until(lambda: order == [0, 1, 2], "task 2 made after 1 finished")
    assert not futures[0].done() and window.busy == 2
    for seq in (0, 2):
        made[seq].release.set()
        futures[seq].wait(WAIT)
    assert (window.busy, window.next) == (0, 0)


def test_a_window_is_reset_after_an_abort_and_refuses_no_room():
    """reset(): what was under way is dropped (abort), the next round starts at 0; a window needs room for one."""
    window = Window(1, 4)
    window.busy, window.next = 1, 3
    window.reset()
    assert (window.busy, window.next) == (0, 0)
    for size, count in ((0, 4), (1, 0)):
        with pytest.raises(ValueError, match="at least 1"):
            Window(size, count)


def test_a_windowed_task_whose_turn_has_come_starts_on_the_submitting_thread(pt):
    """now=True: task 0 is made at once, here (a short backward would otherwise be over before the progress thread
    wakes); task 1, with no room yet, is made on the progress thread once 0 has finished."""
    window, makers = Window(1, 2), []

    def make():
        makers.append(threading.current_thread().name)
        return Countdown(2)
    first = WindowedTask(window, 0, make, now=True)
    second = WindowedTask(window, 1, make, now=True)
    assert makers == [threading.current_thread().name] and first.task is not None and second.task is None
    futures = [pt.submit(first), pt.submit(second)]
    for fut in futures:
        fut.wait(WAIT)
    assert makers[1:] == ["test-progress"] and (window.busy, window.next) == (0, 0)
