"""Under emulated compute: the copies a GPU model's gradients make to and from pinned host memory, waited, not made."""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from mpicomm.progress import require_thread_multiple

from ..grad_buffers import GradientBuffers
from .staging import coalesce


class EmulatedStaging:
    """GradientStaging's timing for an emulated model (runtime.emulate), whose gradients are in host memory already.

    On a GPU each gradient is copied to pinned host memory on a side stream
    as backward finalises it, and a staging thread hands it to the strategy
    once that copy alone is done, while backward goes on; the averages go
    back on that stream before the update. Here the same thread waits each
    copy's modelled time (kind "d2h") on its own clock, which serialises the
    copies as one copy engine does, each starting no earlier than its
    gradient was ready, then delivers; `to_device` waits the copies back
    (kind "h2d") on the calling thread's clock, ahead of the update that
    waits for them on the GPU. Nothing is copied: the strategy works on the
    gradients where they are.
    """

    def __init__(self, acc, buffers: GradientBuffers, deliver: Callable[[int], None],
                 interrupt: Callable[[], None] = lambda: None, timeline=None):
        require_thread_multiple()  # the strategy starts MPI from the staging thread
        self.acc, self.buffers, self.deliver, self.interrupt, self.timeline = acc, buffers, deliver, interrupt, timeline
        self.nbytes = [p.numel() * p.element_size() for p in buffers.params]
        self.copies_to_host = self.copies_to_device = 0
        self.error: BaseException | None = None
        self.outstanding = [False] * len(buffers.params)  # averaged on the host, not yet back on the "device"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="mpitrain-staging", daemon=True)
        self._thread.start()

    def to_host(self, i: int) -> None:
        """Parameter i's gradient is final: deliver(i) once its modelled copy to the host is done."""
        self.copies_to_host += 1
        self.outstanding[i] = True
        with self._idle:
            self._pending += 1
        self._queue.put((i, time.perf_counter()))

    def _run(self) -> None:
        acc = self.acc
        while True:
            item = self._queue.get()
            if item is None:
                return
            i, ready = item
            try:
                # The copy starts when its gradient was ready or when the previous copy ends, not when this
                # thread woke up: the copy engine does not wait for the host.
                acc.clock.begin()
                acc.clock.absorb(time.perf_counter() - ready)
                acc.run("d2h", acc.model.copy_s(self.nbytes[i]))
                if self.timeline:
                    self.timeline.instant(f"on host #{i}", "staging", track="staging")
                if self.error is None:
                    self.deliver(i)
            except BaseException as exc:  # raised on the main thread by drain()
                self.error = self.error or exc
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def drain(self) -> None:
        """Block until every gradient has been delivered (in hook order); re-raise a delivery's error."""
        with self._idle:
            while self._pending:
                self._idle.wait(0.05)
                if self._pending:
                    self.interrupt()  # another rank failed: stop waiting
        if self.error is not None:
            raise self.error

    def to_device(self, indices) -> None:
        """The averages of these parameters go back to the device: their copies' modelled time, on this thread."""
        indices = [i for i in indices if self.outstanding[i]]
        for i in indices:
            self.outstanding[i] = False
        ranges = coalesce(self.buffers.segments, indices)
        if not ranges:
            return
        self.copies_to_device += len(ranges)
        width = {b: f.element_size() for b, f in enumerate(self.buffers.flats)}
        self.acc.issue("h2d", sum(self.acc.model.copy_s((z - a) * width[b]) for b, a, z in ranges))

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)
