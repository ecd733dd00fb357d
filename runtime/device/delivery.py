"""The staging thread: hands each gradient to the strategy once its copy to the host is done, in hook order."""

from __future__ import annotations

import queue
import threading
from typing import Callable

from mpicomm.progress import require_thread_multiple

__all__ = ["Delivery"]


class Delivery:
    """put(i, copy) from a backward hook; on this thread, arrive(i, copy) waits for that copy alone (a CUDA
    event, or an emulated copy's modelled time), then deliver(i) hands gradient i (or bucket i: whatever the
    caller numbers) to the strategy, which starts MPI from here. drain() blocks until everything put so far is
    delivered and re-raises the first delivery's error; while it waits, interrupt() lets a failure elsewhere
    (another rank's) stop it. setup: run first on the thread (device_setup: the GPU it waits on)."""

    def __init__(self, arrive: Callable, deliver: Callable[[int], None], interrupt: Callable[[], None],
                 timeline=None, setup: Callable[[], None] | None = None):
        require_thread_multiple()
        self.arrive, self.deliver, self.interrupt, self.timeline = arrive, deliver, interrupt, timeline
        self.setup = setup
        self.error: BaseException | None = None
        self._stopped = False  # stop(): what is queued is skipped
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.RLock()  # entered itself, never through the Condition (mpicomm.progress.ABORT_JOIN)
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="mpitrain-staging", daemon=True)
        self._thread.start()

    def put(self, i: int, copy) -> None:
        with self._lock:
            self._pending += 1
        self._queue.put((i, copy))

    def _run(self) -> None:
        if self.setup is not None:
            try:
                self.setup()
            except BaseException as exc:  # every later item is skipped; drain() raises it
                self.error = exc
        while True:
            item = self._queue.get()
            if item is None:
                return
            i, copy = item
            try:
                self.arrive(i, copy)
                if self.timeline:
                    self.timeline.instant(f"on host #{i}", "staging", track="staging")
                if self.error is None and not self._stopped:
                    self.deliver(i)
            except BaseException as exc:  # raised on the main thread by drain()
                self.error = self.error or exc
            finally:
                with self._lock:
                    self._pending -= 1
                    self._idle.notify_all()

    def drain(self) -> None:
        with self._lock:
            while self._pending:
                self._idle.wait(0.05)
                if self._pending:
                    self.interrupt()  # another rank failed: stop waiting
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """Hand nothing more over, and return once a hand-over under way is done: a strategy about to abort then
        finds everything this thread started (what it posted after the abort would be in nothing the abort
        cancels). From the thread itself (a delivery failed): the flag alone."""
        self._stopped = True
        if threading.current_thread() is not self._thread:
            self.close()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)
