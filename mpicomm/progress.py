"""A background thread that drives non-blocking MPI work while the main thread computes."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import weakref

from mpi4py import MPI


# Sleeps this long or longer wait on an Event that nudge() sets; shorter ones are plain sleeps.
NUDGE_FROM = 200e-6
# An idle thread's wait on its condition is timed: a notify() that a KeyboardInterrupt cut short after it woke
# the thread leaves that thread's wake-up lock queued, and the next notify() releases it instead of the thread's
# new one (CPython's Condition; gh-92530 mended only the case where the lock is still released). Untimed, the
# thread, and the training thread joining it in abort(), would wait for ever after a ^C that a loop caught.
LOST_WAKEUP = 0.5
# How long abort() (the error path) waits for the thread to end. A KeyboardInterrupt can also land in a Python-level
# __enter__ (Condition's, Event's) after it took the lock and before the with-block began (gh-74174): that lock
# stays held by the training thread for ever, and a thread that needs it never ends. The locks of this package's
# conditions are entered directly (C-level, which leaves no such gap), but a task's or torch's may not be; past
# this the error path goes on without the thread (a daemon) rather than hang until the fail-stop watcher ends the
# rank (PICKUP, 3 s) with "blocked ... where no wait looks".
ABORT_JOIN = 1.0
DRIVE_ENV = "MPITRAIN_PROGRESS_DRIVE"  # "off": never drive (ProgressThread's drive), for before/after comparisons
_RUNNING: "weakref.WeakSet[ProgressThread]" = weakref.WeakSet()  # started, neither stopped nor aborted


def running() -> list["ProgressThread"]:
    """Progress threads still running: at exit they would call MPI during and after MPI_Finalize."""
    return [t for t in list(_RUNNING) if t._thread.is_alive()]


class ThreadLevelError(RuntimeError):
    """The MPI library was not initialised with the thread support a progress thread needs."""


def require_thread_multiple() -> None:
    """A progress thread calls MPI while the main thread may too: only MPI_THREAD_MULTIPLE allows that."""
    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED"}
        raise ThreadLevelError(
            f"MPI provides thread level {names.get(level, level)}, a progress thread needs MULTIPLE: "
            "leave mpi4py.rc.thread_level at its default 'multiple' before importing mpi4py.MPI")


def _drive_allowed() -> bool:
    value = os.environ.get(DRIVE_ENV, "auto").strip().lower()
    if value not in ("auto", "off"):
        raise ValueError(f"{DRIVE_ENV} must be 'auto' or 'off', got {value!r}")
    return value == "auto"


class Task:
    """One unit of background work: `poll()` makes progress and returns True once finished.

    A task may also define `idle_sleep()`: the longest the thread may sleep
    between polls while nothing completes (seconds; 0: do not sleep, only yield
    the core); the thread's own max_sleep applies otherwise, and `cancel()`:
    drop what it started (its owner's error path; submit() to a stopped thread).
    """

    def poll(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class Future:
    """Completion of a submitted task; `wait()` re-raises the task's exception."""

    __slots__ = ("_event", "error", "task")

    def __init__(self, task):
        self.task, self.error, self._event = task, None, threading.Event()

    def done(self) -> bool:
        return self._event.is_set()

    def wait_done(self, timeout: float) -> bool:
        """Block up to `timeout` seconds; True once the task finished (successfully or not)."""
        return self._event.wait(timeout)

    def wait(self, timeout: float | None = None):
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.task!r} not finished after {timeout} s")
        if self.error is not None:
            raise self.error
        return self.task


class ProgressThread:
    """Polls submitted tasks round-robin; sleeps with back-off when nothing moves.

    MPICH makes progress only inside MPI calls, so someone must keep calling
    Test* while torch computes. Polling without pause would take a core from
    the ranks that compute (four ranks on two cores here), so an idle loop
    backs off from `min_sleep` to `max_sleep`; any completion resets it.
    The cap trades latency for CPU: with 1 ms, P3's exchange of VGG-19 took
    2.3 s instead of 0.8 s (50K-element slices, benchmarks/strategies.md). A task that
    knows better sets the cap itself (`Task.idle_sleep`: p3 relaxes it while
    no layer waits and the wire is the limit), and `nudge()` ends a sleep
    early when a waiter needs completions seen at once.

    drive: while a training thread blocks on this thread's work (`driven()`),
    poll without sleeping, yielding the core between polls, as a blocking wait
    drives MPI (mpicomm.stall's DRIVE). For ranks whose compute is off the host's
    cores (a GPU, or an emulated one): the waiting rank has nothing else to run,
    and a sleep's wake-up comes late where ranks share cores (8 emulated V100
    hosts on 2 cores, ResNet-50 at 1 Gbit/s: wfbp's step 2.61 -> 2.07 s, the
    medians of 8 interleaved runs, benchmarks/claims.md). Ranks computing on
    the CPU keep the back-off: spinning would take their neighbours' cores.

    setup: called first on the thread, before any task (a task that touches a
    GPU needs the thread's current device set: runtime.device.threads); if it
    raises, every task submitted fails with its error.
    """

    def __init__(self, name: str = "mpitrain-progress", min_sleep: float = 10e-6, max_sleep: float = 100e-6,
                 drive: bool = False, setup=None):
        require_thread_multiple()
        self.setup = setup
        self._setup_error: BaseException | None = None
        self._pending: collections.deque = collections.deque()
        self._lock = threading.RLock()  # entered itself, never through the Condition: see ABORT_JOIN
        self._cv = threading.Condition(self._lock)
        self._stop = False
        self.min_sleep, self.max_sleep = min_sleep, max_sleep
        self.drive = drive and _drive_allowed()
        self._drivers = 0  # training threads blocked in driven()
        self._drivers_lock = threading.Lock()
        self._nudged = threading.Event()
        self.name = name
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    def submit(self, task: Task) -> Future:
        """Queue `task` for polling. Refused once the thread is stopping: a task that has started collectives (a
        HandleTask made them) is then cancelled here, since no future holds it for its owner's abort to find (an
        abort on another thread may come between a task's making and its submission)."""
        fut = Future(task)
        with self._lock:
            refused = self._stop
            if not refused:
                self._pending.append(fut)
                self._cv.notify()
        if refused:
            cancel = getattr(task, "cancel", None)
            if cancel is not None:
                cancel()
            raise RuntimeError("progress thread already stopped")
        return fut

    def _run(self) -> None:
        if self.setup is not None:
            try:
                self.setup()
            except BaseException as exc:  # raised by every task instead of running it
                self._setup_error = exc
        sleep = self.min_sleep
        while True:
            with self._lock:
                while not self._pending and not self._stop:
                    self._cv.wait(LOST_WAKEUP)
                if self._stop and not self._pending:
                    return
                batch = list(self._pending)
            finished, caps = [], []
            for fut in batch:
                try:
                    if self._setup_error is not None:
                        raise self._setup_error
                    if fut.task.poll():
                        finished.append(fut)
                    else:
                        hint = getattr(fut.task, "idle_sleep", None)
                        caps.append(self.max_sleep if hint is None else hint())
                except BaseException as exc:  # surfaced to whoever waits on the future
                    fut.error = exc
                    finished.append(fut)
                    tell = getattr(fut.task, "fail", None)
                    if tell is not None:
                        tell(exc)  # a task with waiters of its own wakes them with the error
            if finished:
                with self._lock:
                    for fut in finished:
                        if fut in self._pending:  # abort() may have dropped it meanwhile
                            self._pending.remove(fut)
                for fut in finished:
                    fut._event.set()
                sleep = self.min_sleep
            else:
                cap = 0.0 if self._drivers else min(caps, default=self.max_sleep)  # only drive counts drivers
                if cap <= 0:
                    os.sched_yield()  # driven: the core goes to whoever else is runnable, then poll again
                    sleep = self.min_sleep
                    continue
                sleep = self.min_sleep if self._idle(min(sleep, cap)) else min(cap, sleep * 2)

    def _idle(self, seconds: float) -> bool:
        """Sleep between polls; True when nudge() ended it early."""
        if seconds < NUDGE_FROM:
            time.sleep(seconds)  # an Event's wait costs more than the nudge would save
            return False
        nudged = self._nudged.wait(seconds)
        self._nudged.clear()
        return nudged

    def nudge(self) -> None:
        """Poll again now (a waiter needs completions seen at once): ends the current sleep early."""
        self._nudged.set()

    @contextlib.contextmanager
    def driven(self):
        """A training thread blocks on this thread's tasks meanwhile: with `drive`, poll without sleeping."""
        if not self.drive:
            yield
            return
        with self._drivers_lock:
            self._drivers += 1
        self.nudge()
        try:
            yield
        finally:
            with self._drivers_lock:
                self._drivers -= 1

    def stop(self) -> None:
        """Finish what was submitted, then end the thread."""
        with self._lock:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()
        _RUNNING.discard(self)

    def abort(self, timeout: float = ABORT_JOIN) -> bool:
        """Error path: drop what is pending (its owner cancels the requests) and end the thread; False when it had
        not ended after `timeout` seconds (blocked on a lock a ^C left held: ABORT_JOIN), and is left behind."""
        with self._lock:
            self._pending.clear()
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False  # still in _RUNNING: the exit's safety net (mpicomm.shutdown) names it
        _RUNNING.discard(self)
        return True


class HandleTask(Task):
    """Adapts a collective Handle (mpicomm.handle) to the progress thread."""

    __slots__ = ("handle", "on_done")

    def __init__(self, handle, on_done=None):
        self.handle, self.on_done = handle, on_done

    def poll(self) -> bool:
        if not self.handle.test():
            return False
        if self.on_done is not None:
            self.on_done(self.handle)
        return True

    def cancel(self) -> None:
        self.handle.cancel()

    def __repr__(self) -> str:
        return f"HandleTask({self.handle!r})"


class Window:
    """Starts its tasks in sequence 0, 1 ... count-1 (then 0 again), at most `size` of them under way at once.

    Every rank starts the same collectives in the same order, whatever order they
    became ready in (a branch taken on one rank only): no two ranks can each hold
    a slot that the other's collective needs.
    """

    __slots__ = ("size", "count", "busy", "next", "_lock")

    def __init__(self, size: int, count: int):
        if size < 1 or count < 1:
            raise ValueError(f"a window holds at least 1 task of at least 1, got {size} of {count}")
        self.size, self.count = size, count
        self.busy = self.next = 0
        self._lock = threading.Lock()  # the submitting thread may claim a slot while the progress thread does

    def claim(self, seq: int) -> bool:
        """Take a slot for task `seq` if its turn has come and there is room."""
        with self._lock:
            if seq != self.next or self.busy >= self.size:
                return False
            self.busy += 1
            self.next = (self.next + 1) % self.count
            return True

    def release(self) -> None:
        with self._lock:
            self.busy -= 1

    def reset(self) -> None:
        """After an abort: what was under way is dropped; the next round starts at task 0."""
        with self._lock:
            self.busy = self.next = 0


class WindowedTask(Task):
    """The task `make()` returns (a HandleTask, say), made once its window reaches `seq` and has room; the
    window's next task may start the moment this one finishes.

    now: try first on the calling thread, so that a task whose turn has come starts at once rather than when
    the progress thread next wakes (which, on busy cores, can be after a short backward pass is over).
    """

    __slots__ = ("window", "seq", "make", "task")

    def __init__(self, window: Window, seq: int, make, now: bool = False):
        self.window, self.seq, self.make, self.task = window, seq, make, None
        if now and window.claim(seq):
            self.task = make()

    def poll(self) -> bool:
        if self.task is None:
            if not self.window.claim(self.seq):
                return False
            self.task = self.make()
        if not self.task.poll():
            return False
        self.window.release()
        return True

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def __repr__(self) -> str:
        return f"WindowedTask({self.seq}, {self.task!r})"


class HandlesTask(Task):
    """Several handles on the progress thread; `on_done()` once all have completed."""

    __slots__ = ("handles", "on_done")

    def __init__(self, handles, on_done):
        self.handles, self.on_done = handles, on_done

    def poll(self) -> bool:
        if not all([h.test() for h in self.handles]):
            return False
        for h in self.handles:
            h.wait()  # re-raises a failed collective's error
        self.on_done()
        return True

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

    def __repr__(self) -> str:
        return f"HandlesTask({self.handles!r})"
