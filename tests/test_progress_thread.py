"""The progress thread: round-robin polling, errors to the waiter, stop, abort, back-off, and HandleTask."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from conftest import ROOT
from mpicomm import Handle, Ring
from mpicomm.progress import DRIVE_ENV, HandleTask, ProgressThread, Task, require_thread_multiple
from mpicomm.requests import RequestLog

WAIT = 30.0  # seconds: only a hang-detector, never a measured time


class Countdown(Task):
    """Finishes on its n-th poll; with n=None only once `release` is set. Counts its polls."""

    def __init__(self, n=None):
        self.n, self.polls, self.release = n, 0, threading.Event()

    def poll(self) -> bool:
        self.polls += 1
        return self.release.is_set() if self.n is None else self.polls >= self.n


class Boom(Task):
    """Raises on its first poll."""

    def __init__(self, error):
        self.error, self.polls = error, 0

    def poll(self) -> bool:
        self.polls += 1
        raise self.error


class BoomWithWaiters(Boom):
    """Raises, and has a `fail()` hook the thread must call with the error (SlicedExchange has one)."""

    def __init__(self, error):
        super().__init__(error)
        self.failed = []

    def fail(self, error):
        self.failed.append(error)


class SleepLog:
    """Records each back-off sleep of ProgressThread (short ones sleep, long ones wait for a nudge), then does it."""

    def __init__(self, monkeypatch):
        self.calls: list[float] = []
        real = ProgressThread._idle

        def idle(thread, seconds):
            self.calls.append(seconds)
            return real(thread, seconds)
        monkeypatch.setattr(ProgressThread, "_idle", idle)


def until(condition, what: str) -> None:
    """Wait (hang-detector only) until condition() holds."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {WAIT} s"
        time.sleep(1e-3)


@contextlib.contextmanager
def polling_a_stuck_task(name: str, **kwargs):
    """A ProgressThread polling a task that finishes only when the block ends: (thread, task)."""
    thread = ProgressThread(name, **kwargs)
    stuck = Countdown(None)
    try:
        thread.submit(stuck)
        yield thread, stuck
    finally:
        stuck.release.set()
        thread.stop()


@pytest.fixture
def pt():
    thread = ProgressThread("test-progress")
    yield thread
    thread.abort()  # idempotent after stop(); never waits for a task a failed test left pending


@pytest.fixture
def self_comm():
    comm = MPI.COMM_SELF.Dup()
    yield comm
    comm.Free()


def message_to_self(comm, buf, tag: int) -> Handle:
    """A real handle (mpicomm.handle) that completes only once this process sends itself a message."""
    log = RequestLog()

    def algorithm():
        yield [log.irecv(comm, buf, 0, tag)]
        return buf
    return Handle("message to self", algorithm(), log)


def test_tasks_are_polled_until_done_and_then_no_more(pt):
    """Each task is polled exactly until its poll() returns True: a thread that stopped early, or kept polling
    finished tasks (never removing them), gets other counts."""
    tasks = [Countdown(n) for n in (1, 5, 17)]
    futures = [pt.submit(t) for t in tasks]
    for fut, task in zip(futures, tasks):
        assert fut.wait(WAIT) is task
        assert fut.done()
    time.sleep(0.01)  # a thread still polling finished tasks would move the counts on meanwhile
    assert [t.polls for t in tasks] == [1, 5, 17]


def test_a_task_that_never_finishes_does_not_starve_the_others(pt):
    """Round robin: a thread that polled only the oldest task until it finished would never get to `quick`."""
    stuck, quick = Countdown(None), Countdown(3)
    stuck_future = pt.submit(stuck)
    until(lambda: stuck.polls > 0, "the first poll of the stuck task")
    quick_future = pt.submit(quick)
    assert quick_future.wait(WAIT) is quick
    assert not stuck_future.done() and stuck.polls >= quick.polls  # polled alongside, not finished
    stuck.release.set()
    assert stuck_future.wait(WAIT) is stuck


def test_an_error_reaches_the_waiter_and_the_tasks_fail_hook(pt):
    """The exception object itself surfaces from Future.wait() and goes to fail() once; the thread lives on.

    Broken variants caught: an exception that kills the thread (wait times out instead), one swallowed as
    success (wait returns), a fail() hook not called (SlicedExchange's waiters would sleep for ever).
    """
    error = ValueError("poll failed")
    hooked = BoomWithWaiters(error)
    future = pt.submit(hooked)
    with pytest.raises(ValueError) as info:
        future.wait(WAIT)
    assert info.value is error and future.error is error
    assert hooked.failed == [error] and hooked.polls == 1  # failed once, never polled again

    plain = Boom(KeyError("no hook"))
    with pytest.raises(KeyError, match="no hook"):
        pt.submit(plain).wait(WAIT)

    after = Countdown(2)
    assert pt.submit(after).wait(WAIT) is after  # the thread survived both


def test_stop_finishes_what_was_submitted_first():
    """stop() returns only after every submitted task finished: a stop that dropped the queue leaves them undone."""
    thread = ProgressThread("test-stop")
    tasks = [Countdown(n) for n in (40, 80, 120)]
    futures = [thread.submit(t) for t in tasks]
    thread.stop()
    assert all(f.done() for f in futures) and [t.polls for t in tasks] == [40, 80, 120]
    assert not thread._thread.is_alive()
    for f in futures:
        f.wait(0)


def test_abort_drops_pending_tasks_and_returns_without_waiting_for_them():
    """abort() with a task that would never finish: it must return (a stop() in disguise hangs) and leave the
    task's future unset, the task no longer polled."""
    thread = ProgressThread("test-abort")
    stuck = Countdown(None)
    future = thread.submit(stuck)
    until(lambda: stuck.polls > 0, "the first poll")
    aborting = threading.Thread(target=thread.abort, daemon=True)
    aborting.start()
    aborting.join(WAIT)
    try:
        assert not aborting.is_alive(), "abort() waited for a task that never finishes"
        assert not thread._thread.is_alive()
        assert not future.done()
        polls = stuck.polls
        time.sleep(0.01)
        assert stuck.polls == polls
    finally:
        stuck.release.set()  # lets a broken abort() that waits for it end


@pytest.mark.parametrize("end", ["stop", "abort"])
def test_submit_after_the_end_raises_and_cancels_the_task(end):
    """A refused task is in no future: what it started is cancelled here (an abort on another thread may have come
    between its making and its submission), once; a task without cancel() is refused alike."""
    thread = ProgressThread("test-end")
    getattr(thread, end)()
    task, cancels = Countdown(1), []
    task.cancel = lambda: cancels.append(1)
    for t in (task, Countdown(1)):
        with pytest.raises(RuntimeError, match="already stopped"):
            thread.submit(t)
    assert cancels == [1] and task.polls == 0


def test_the_idle_thread_blocks_without_polling_or_sleeping(monkeypatch):
    """With nothing submitted the thread waits on its condition: a loop that slept and looked again would
    log sleeps here."""
    log = SleepLog(monkeypatch)
    thread = ProgressThread("test-idle")
    try:
        time.sleep(0.05)
        assert log.calls == []
    finally:
        thread.stop()


def test_a_thread_waiting_on_an_unfinished_task_backs_off(monkeypatch):
    """Every pass that finishes nothing sleeps, doubling from min_sleep up to max_sleep; a completion resets it.

    Counted in calls, not time: a busy loop (no sleep, or a sleep that never grows) polls the stuck task
    many times per sleep recorded here, or records sleeps that do not double.
    """
    log = SleepLog(monkeypatch)
    lo, hi = 1e-4, 1.6e-3
    thread = ProgressThread("test-backoff", min_sleep=lo, max_sleep=hi)
    stuck = Countdown(None)
    try:
        thread.submit(stuck)
        until(lambda: stuck.polls >= 12, "12 polls")
        polls = stuck.polls
        sleeps = list(log.calls)
        assert len(sleeps) >= polls - 1  # one sleep per idle pass (the latest may not have slept yet)
        assert sleeps[:7] == pytest.approx([lo, 2 * lo, 4 * lo, 8 * lo, hi, hi, hi])

        before = len(log.calls)
        assert thread.submit(Countdown(1)).wait(WAIT)
        until(lambda: len(log.calls) >= before + 8, "sleeps after the completion")
        after = log.calls[before:]
        reset = after.index(pytest.approx(lo))  # the first sleep after the pass that finished a task
        assert all(s == pytest.approx(hi) for s in after[:reset])
        assert after[reset:reset + 3] == pytest.approx([lo, 2 * lo, 4 * lo])
    finally:
        stuck.release.set()
        thread.stop()


class Relaxed(Countdown):
    """Never finishes by itself; tells the thread how long it may sleep between polls (SlicedExchange does)."""

    def __init__(self, cap):
        super().__init__(None)
        self.cap = cap

    def idle_sleep(self) -> float:
        return self.cap


def test_a_task_caps_the_back_off_itself_and_a_nudge_ends_a_sleep(monkeypatch):
    """The task's idle_sleep() is the cap, even above the thread's max_sleep; nudge() cuts the sleep short
    (the back-off starts again at min_sleep instead of sleeping the cap once more)."""
    log = SleepLog(monkeypatch)
    lo, cap = 1e-4, 0.05
    thread = ProgressThread("test-cap", min_sleep=lo, max_sleep=2e-4)
    task = Relaxed(cap)
    try:
        thread.submit(task)
        until(lambda: log.calls.count(cap) >= 2, "sleeps at the task's cap")
        assert log.calls[:4] == pytest.approx([lo, 2 * lo, 4 * lo, 8 * lo]) and max(log.calls) == cap
        before = len(log.calls)
        thread.nudge()
        until(lambda: len(log.calls) >= before + 2, "sleeps after the nudge")
        assert pytest.approx(lo) in log.calls[before:before + 2], log.calls[before:]
    finally:
        task.release.set()
        thread.stop()


def test_a_driven_thread_polls_without_sleeping_while_a_waiter_blocks_then_backs_off_again(monkeypatch):
    """drive=True: inside driven() a pass that finishes nothing yields the core instead of sleeping (a waiting
    rank with its compute off the host drives MPI, as a blocking wait does); after it, the back-off resumes."""
    log = SleepLog(monkeypatch)
    lo, hi = 1e-4, 1.6e-3
    with polling_a_stuck_task("test-drive", min_sleep=lo, max_sleep=hi, drive=True) as (thread, stuck):
        until(lambda: len(log.calls) >= 6, "back-off sleeps before anyone waits")
        with thread.driven():
            time.sleep(0.01)  # let a sleep begun before driven() end (the nudge cuts a long one short)
            sleeps, polls = len(log.calls), stuck.polls
            until(lambda: stuck.polls >= polls + 200, "200 polls while driven")
            assert len(log.calls) == sleeps, f"slept while driven: {log.calls[sleeps:]}"
        until(lambda: len(log.calls) >= sleeps + 5, "sleeps after the waiter left")
        assert log.calls[sleeps:sleeps + 3] == pytest.approx([lo, 2 * lo, 4 * lo])


def test_driven_changes_nothing_without_drive(monkeypatch):
    """drive=False (ranks computing on the host's cores): a waiter's driven() leaves the back-off as it was."""
    log = SleepLog(monkeypatch)
    lo, hi = 1e-4, 4e-4
    with polling_a_stuck_task("test-no-drive", min_sleep=lo, max_sleep=hi) as (thread, _):
        with thread.driven():
            until(lambda: len(log.calls) >= 20, "sleeps while a waiter blocks")
            assert log.calls[:3] == pytest.approx([lo, 2 * lo, hi]) and all(0 < s <= hi for s in log.calls)


def test_drive_can_be_switched_off_for_a_before_and_after(monkeypatch):
    monkeypatch.setenv(DRIVE_ENV, "off")
    thread = ProgressThread("test-drive-off", drive=True)
    thread.stop()
    assert thread.drive is False
    monkeypatch.setenv(DRIVE_ENV, "sometimes")
    with pytest.raises(ValueError, match="MPITRAIN_PROGRESS_DRIVE must be 'auto' or 'off', got 'sometimes'"):
        ProgressThread("test-drive-bad", drive=True)


def test_require_thread_multiple_passes_at_the_default_thread_level():
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
    require_thread_multiple()


def test_require_thread_multiple_refuses_a_lower_thread_level():
    """In a process that initialised MPI at SERIALIZED, both the check and a ProgressThread refuse (so the
    check above is not vacuous)."""
    code = ("import mpi4py; mpi4py.rc.thread_level = 'serialized'\n"
            "from mpi4py import MPI\n"
            "from mpicomm.progress import ProgressThread, ThreadLevelError, require_thread_multiple\n"
            "for call in (require_thread_multiple, ProgressThread):\n"
            "    try:\n"
            "        call()\n"
            "    except ThreadLevelError as e:\n"
            "        print('refused:', e)\n"
            "    else:\n"
            "        print('accepted')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout
    assert all(line.startswith("refused: MPI provides thread level SERIALIZED") for line in lines), out.stdout


def test_handle_task_calls_on_done_once_with_the_finished_handle(pt):
    """A COMM_SELF ring allreduce (complete at once): on_done gets the handle, exactly once."""
    with Ring(MPI.COMM_SELF) as ring:
        x = np.arange(6, dtype=np.float32)
        handle = ring.allreduce(x)
        calls = []
        task = HandleTask(handle, calls.append)
        assert pt.submit(task).wait(WAIT) is task
        assert calls == [handle] and np.array_equal(handle.wait(), np.arange(6, dtype=np.float32))
        assert pt.submit(HandleTask(ring.allreduce(x))).wait(WAIT)  # on_done is optional


def test_handle_task_waits_for_its_handle_then_calls_on_done_once(pt, self_comm):
    """A handle on a real receive: polled while the message is missing without calling on_done (a HandleTask
    that called it on every poll, or before the handle completed, is caught), then exactly once."""
    got = np.zeros(4, dtype=np.int64)
    handle = message_to_self(self_comm, got, tag=7)
    calls = []
    future = pt.submit(HandleTask(handle, lambda h: calls.append((h, got.copy()))))
    time.sleep(0.02)  # some polls of the pending handle
    assert not future.done() and calls == []
    self_comm.Send(np.array([3, 1, 4, 1], dtype=np.int64), dest=0, tag=7)
    future.wait(WAIT)
    assert len(calls) == 1 and calls[0][0] is handle and calls[0][1].tolist() == [3, 1, 4, 1]
    time.sleep(0.01)
    assert len(calls) == 1


def test_handle_task_passes_on_the_handles_error(pt):
    """A collective that failed (mismatched output buffer): the error reaches the waiter, on_done is not called."""
    with Ring(MPI.COMM_SELF) as ring:
        calls = []
        future = pt.submit(HandleTask(ring.allreduce(np.ones(4, np.float32), np.ones(3, np.float32)), calls.append))
        with pytest.raises(TypeError, match="out has 3"):  # mpicomm.BufferError is a TypeError
            future.wait(WAIT)
        assert calls == []


def test_setup_runs_first_on_the_thread_and_its_error_fails_every_task():
    """What a thread serving a GPU needs before any task (runtime.device.threads: set_device) runs on it."""
    ran = []
    pt = ProgressThread("test-setup", setup=lambda: ran.append(threading.get_ident()))
    try:
        task = Countdown(1)
        pt.submit(task).wait(WAIT)
        assert ran == [pt._thread.ident] and task.polls == 1
    finally:
        pt.stop()

    def broken():
        raise RuntimeError("no such device")

    pt = ProgressThread("test-setup-fails", setup=broken)
    try:
        task = Countdown(1)
        with pytest.raises(RuntimeError, match="no such device"):
            pt.submit(task).wait(WAIT)
        assert task.polls == 0
    finally:
        pt.stop()
