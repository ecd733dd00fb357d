"""Gradients between a GPU and the pinned host mirror that MPI works on, on a side stream, without device syncs."""

from __future__ import annotations

import threading
from typing import Callable

import torch

from ..grad_buffers import GradientBuffers
from .delivery import Delivery


def coalesce(segments: list[tuple[int, int, int]], indices) -> list[tuple[int, int, int]]:
    """(buffer, start, stop) ranges covering these parameters' segments, adjacent ones merged: fewer copies."""
    ranges: list[list[int]] = []
    for b, a, z in sorted(segments[i] for i in indices):
        if a == z:
            continue
        if ranges and ranges[-1][0] == b and ranges[-1][2] == a:
            ranges[-1][2] = z
        else:
            ranges.append([b, a, z])
    return [tuple(r) for r in ranges]


class GradientStaging:
    """Device -> host as each gradient is final, host -> device once its average is back.

    On a GPU: when backward finalises parameter i, an event is recorded on
    the stream that produced the gradient, a side stream waits for it and
    copies the gradient into the pinned mirror (non-blocking), and a staging
    thread waits for that copy alone before handing i to the strategy (which
    then starts MPI on host memory): the GPU goes on computing earlier
    layers meanwhile, and nothing synchronises the whole device. After
    `strategy.wait(indices)` the averaged values go back on the side stream
    and the current stream waits on an event, so the optimizer's update, or
    the layer's next forward pass (p3), runs after them on the GPU, without
    the CPU waiting. A strategy that completes averages a group at a time on
    its own thread (wfbp's buckets, p3's tensors) calls `averaged(indices)`
    there instead: those go back at once, on a stream of their own (the
    second copy engine), behind the exchange of the rest, and `to_device`
    only makes the current stream wait for them. Events are made once per
    parameter and reused.

    On a CPU model under MPITRAIN_STAGING=force the same bookkeeping runs
    with synchronous copies and no thread: how CI checks it without a GPU.
    """

    def __init__(self, buffers: GradientBuffers, deliver: Callable[[int], None],
                 interrupt: Callable[[], None] = lambda: None, timeline=None):
        if not buffers.staged:
            raise ValueError("GradientStaging needs GradientBuffers built with staged=True (a host mirror)")
        self.buffers, self.deliver, self.interrupt, self.timeline = buffers, deliver, interrupt, timeline
        self.device = buffers.device
        self.cuda = self.device.type == "cuda"
        self.copies_to_host = self.copies_to_device = 0  # per-range copies issued (reported, tested)
        self.copies_as_averaged = 0  # of copies_to_device, those averaged() made as the exchange finished them
        # Whose average is still in the mirror only: each goes back once per step, so that what the
        # user does to .grad after synchronize() (clipping) is not overwritten by step()'s wait.
        self.outstanding = [False] * len(buffers.params)
        # Those sent back early (averaged): per parameter, (the sequence number of the copy that took it, the index
        # of the event recorded after it), None if none.
        n = len(buffers.params)
        self._early: list[tuple[int, int] | None] = [None] * n
        self._sent_back = 0
        self._lock = threading.Lock()  # averaged() runs on the strategy's thread, to_device() on the training one
        if not self.cuda:
            return
        self.stream = torch.cuda.Stream(self.device)
        self.back_stream = torch.cuda.Stream(self.device)  # averaged()'s copies: not queued behind the gradients'
        self.produced = [torch.cuda.Event() for _ in range(n)]  # gradient i final on its compute stream
        self.copied = [torch.cuda.Event() for _ in range(n)]  # its host copy complete
        self.returned = torch.cuda.Event()  # the last averaged values are back on the device
        self.back = [torch.cuda.Event() for _ in range(n)]  # back[j]: averaged()'s copy whose last index is j
        self._thread_device = threading.local()
        # This copy only (synchronize releases the GIL), never the device; then the strategy gets i.
        self.delivery = Delivery(lambda i, event: event.synchronize(), deliver, interrupt, timeline)

    # -- device -> host ------------------------------------------------------
    def to_host(self, i: int) -> None:
        """Parameter i's gradient is final on the device: copy it to the mirror, then deliver(i)."""
        host, dev = self.buffers.flat_views[i], self.buffers.device_flat_views[i]
        self.copies_to_host += 1
        self.outstanding[i] = True
        if not self.cuda:
            host.copy_(dev)
            self.deliver(i)
            return
        # The hook runs on the thread and stream that produced the gradient (autograd's device thread).
        self.produced[i].record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(self.produced[i])
        with torch.cuda.stream(self.stream):
            host.copy_(dev, non_blocking=True)
            self.copied[i].record(self.stream)
        self.delivery.put(i, self.copied[i])

    def drain(self) -> None:
        """Block until every copied gradient has been delivered (in hook order); re-raise a delivery's error."""
        if self.cuda:
            self.delivery.drain()

    # -- host -> device ------------------------------------------------------
    def averaged(self, indices) -> None:
        """On the strategy's thread, as its exchange completes these parameters' averages in the mirror (and
        before any wait for them returns): their copies back to p.grad start now."""
        with self._lock:
            indices, ranges = self._claim(indices)
            if not ranges:
                return
            self.copies_as_averaged += len(ranges)
            self._sent_back += 1
            last = indices[-1]
            for i in indices:
                self._early[i] = (self._sent_back, last)
            if self.cuda and not getattr(self._thread_device, "set", False):  # this thread's CUDA: the model's device
                torch.cuda.set_device(self.device)
                self._thread_device.set = True
            # Issued under the lock, so a to_device() that finds _early set finds the event recorded.
            self._put_back(ranges, self.back_stream if self.cuda else None, self.back[last] if self.cuda else None)
        if self.timeline:
            self.timeline.instant(f"back to {self.device.type} as averaged: {len(indices)} params", "staging",
                                  track="staging", ranges=len(ranges))

    def _claim(self, indices) -> tuple[list[int], list]:
        """Those of these parameters whose average is still in the mirror only, marked as going back now, and
        their coalesced ranges (counted in copies_to_device). Under the lock."""
        indices = [i for i in indices if self.outstanding[i]]
        for i in indices:
            self.outstanding[i] = False
        ranges = coalesce(self.buffers.segments, indices)
        self.copies_to_device += len(ranges)
        return indices, ranges

    def _put_back(self, ranges, stream, event) -> None:
        """Copy these ranges of the mirror into the device's gradients: on a CPU at once, else on `stream`
        (non-blocking, from pinned memory), recording `event` after them."""
        b = self.buffers
        if not self.cuda:
            for k, a, z in ranges:
                b.device_flats[k][a:z].copy_(b.flats[k][a:z])
            return
        with torch.cuda.stream(stream):
            for k, a, z in ranges:
                b.device_flats[k][a:z].copy_(b.flats[k][a:z], non_blocking=True)
            event.record(stream)

    def _wait_early(self, indices) -> None:
        """The current stream waits for averaged()'s copies of these parameters (the latest recorded one: the
        copies run in order on their stream); on a CPU they are done already."""
        latest = None
        for i in indices:
            early, self._early[i] = self._early[i], None
            if early is not None and (latest is None or early[0] > latest[0]):
                latest = early
        if latest is not None and self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.back[latest[1]])

    def to_device(self, indices) -> None:
        """The strategy averaged these parameters' gradients in the mirror: put them back in p.grad (those that
        averaged() sent back already: wait for their copies)."""
        with self._lock:
            self._wait_early(indices)
            indices, ranges = self._claim(indices)
        if self.timeline and ranges:
            self.timeline.instant(f"back to {self.device.type}: {len(indices)} params", "staging", track="staging",
                                  ranges=len(ranges))
        if not ranges:
            return
        self._put_back(ranges, self.stream if self.cuda else None, self.returned if self.cuda else None)
        if not self.cuda:
            return
        # The update (or the next forward pass) queues behind the copies; the CPU does not wait.
        torch.cuda.current_stream(self.device).wait_event(self.returned)

    def close(self) -> None:
        if self.cuda:
            self.delivery.close()
