"""Under emulated compute: the copies a GPU model's gradients make to and from pinned host memory, waited, not made."""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..emulate.accelerator import ready_at
from ..grad_buffers import GradientBuffers
from .delivery import Delivery
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
    waits for them on the GPU. `averaged(indices)`, called on the strategy's
    thread as its exchange completes them, queues their copies back on that
    thread's clock (the copy engine's timeline) from then on, and `to_device`
    only makes the calling thread's next work start after them (Clock.after),
    as GradientStaging's stream waits for its side stream's event. Nothing is
    copied: the strategy works on the gradients where they are.
    """

    def __init__(self, acc, buffers: GradientBuffers, deliver: Callable[[int], None],
                 interrupt: Callable[[], None] = lambda: None, timeline=None):
        self.acc, self.buffers = acc, buffers
        self.nbytes = [p.numel() * p.element_size() for p in buffers.params]
        self._width = [f.element_size() for f in buffers.flats]  # bytes an element, per flat buffer
        self.copies_to_host = self.copies_to_device = 0
        self.copies_as_averaged = 0  # of copies_to_device, those averaged() made as the exchange finished them
        self.outstanding = [False] * len(buffers.params)  # averaged on the host, not yet back on the "device"
        self.back_at = [0.0] * len(buffers.params)  # sent back by averaged(): when that copy ends (0: not sent)
        self._lock = threading.Lock()  # averaged() runs on the strategy's thread, to_device() on the training one
        self.delivery = Delivery(self._copied, deliver, interrupt, timeline)

    def to_host(self, i: int) -> None:
        """Parameter i's gradient is final, now or at ready_at() (a backward that runs ahead fires the hook
        before its gradient is ready, as a GPU's host does): deliver(i) once its modelled copy to the host is
        done."""
        self.copies_to_host += 1
        self.outstanding[i] = True
        ahead = ready_at()
        self.delivery.put(i, (time.perf_counter(), False) if ahead is None else (ahead, True))

    def _copied(self, i: int, ready: tuple[float, bool]) -> None:
        acc, (at, ahead) = self.acc, ready
        # The copy starts when its gradient was ready or when the previous copy ends, not when this thread
        # woke up: the copy engine does not wait for the host. A gradient handed over ahead is delivered
        # lazily (up to LAZY_S early), so that this thread wakes about once per millisecond of backward, not
        # once per gradient, as the backward's own nodes did when they woke for their hooks.
        acc.clock.begin()
        acc.clock.absorb(time.perf_counter() - at)
        acc.run("d2h", acc.model.copy_s(self.nbytes[i]), lazy=ahead)

    def drain(self) -> None:
        """Block until every gradient has been delivered (in hook order); re-raise a delivery's error."""
        self.delivery.drain()

    def averaged(self, indices, ranges=None) -> None:
        """On the strategy's thread, as its exchange completes these parameters' averages: their copies back
        start now (or when the copies queued before them end), on this thread's clock, which does not wait.
        ranges: the flat ranges copied instead of their segments (GradientStaging.averaged's)."""
        with self._lock:
            if ranges is None:
                indices, seconds, copies = self._claim(indices)
            else:
                indices = self._mark(indices)
                seconds, copies = self._seconds(ranges), len(ranges)
                self.copies_to_device += copies
            if not copies:
                return
            self.copies_as_averaged += copies
            clock = self.acc.clock
            clock.begin()
            self.acc.run("h2d", seconds, wait=False)
            for i in indices:
                self.back_at[i] = clock.deadline

    def to_device(self, indices) -> None:
        """The averages of these parameters go back to the device: their copies' modelled time, on this thread;
        those averaged() sent back already: this thread's next work starts once those copies end."""
        with self._lock:
            early = max((self.back_at[i] for i in indices), default=0.0)
            for i in indices:
                self.back_at[i] = 0.0
            _, seconds, copies = self._claim(indices)
        if early:
            self.acc.clock.after(early)
        if copies:
            self.acc.issue("h2d", seconds)

    def _claim(self, indices) -> tuple[list[int], float, int]:
        """Those of these parameters still outstanding, marked as going back now; the modelled seconds of copying
        their ranges, and how many ranges (copies) that is (counted in copies_to_device). Under the lock."""
        indices = self._mark(indices)
        ranges = coalesce(self.buffers.segments, indices)
        self.copies_to_device += len(ranges)
        return indices, self._seconds(ranges), len(ranges)

    def _mark(self, indices) -> list[int]:
        indices = [i for i in indices if self.outstanding[i]]
        for i in indices:
            self.outstanding[i] = False
        return indices

    def _seconds(self, ranges) -> float:
        """The modelled time of copying these (buffer, start, stop) ranges, one copy each."""
        return sum(self.acc.model.copy_s((z - a) * self._width[b]) for b, a, z in ranges)

    def stop(self) -> None:
        """Before the strategy aborts: no more gradients handed over (Delivery.stop)."""
        self.delivery.stop()

    def close(self) -> None:
        self.delivery.close()
