"""Gradients between a GPU and the pinned host mirror that MPI works on, on a side stream, without device syncs."""

from __future__ import annotations

import threading
from typing import Callable

import torch

from ..grad_buffers import GradientBuffers, coalesce, runs_last_first
from .delivery import Delivery
from .threads import device_setup

GROUP_BYTES = 1 << 20  # gradients go to the host in groups of about this size where the strategy has no buckets


def size_groups(buffers: GradientBuffers, nbytes: int = GROUP_BYTES) -> list[list[int]]:
    """Runs of neighbouring parameters of about nbytes (a large gradient alone), last parameters first
    (backward's order), each within one buffer: how gradients go to the host where the strategy has no buckets.
    A run never reaches across a large gradient, so no gradient waits for more than its neighbours'."""
    sizes = [p.numel() * p.element_size() for p in buffers.params]
    return runs_last_first(sizes, [seg[0] for seg in buffers.segments], nbytes, across_large=False)


class GradientStaging:
    """Device -> host a group at a time as its gradients are final, host -> device once its average is back.

    Gradients go out in groups (`groups`: the strategy's buckets, wfbp's;
    else about GROUP_BYTES of neighbours, size_groups). On a GPU: when
    backward has finalised every gradient of a group, an event is recorded
    on the stream that produced them (on each, if several did), a side stream
    waits for it and copies the group's slice of the flat buffer into the
    pinned mirror (non-blocking; one copy per contiguous range), and a
    staging thread waits for that copy alone (a blocking event: the thread
    sleeps, it does not spin) before handing the group's parameters to the
    strategy (which then starts MPI on host memory): the GPU goes on
    computing earlier layers meanwhile, and nothing synchronises the whole
    device. The thread that launches backward's kernels does one event, one
    wait, one copy per range and one queue put per group, not per parameter.
    After `strategy.wait(indices)` the averaged values go back on the side
    stream and the current stream waits on an event, so the optimizer's
    update, or the layer's next forward pass (p3), runs after them on the
    GPU, without the CPU waiting. A strategy that completes averages a group
    at a time on its own thread (wfbp's buckets, p3's slices, allreduce's
    pieces) calls `averaged(indices)` there instead: those go back at once,
    on a stream of their own (the second copy engine), behind the exchange
    of the rest, and `to_device` only makes the current stream wait for
    them. Events are made once and reused.

    On a CPU model under MPITRAIN_STAGING=force the same bookkeeping runs
    with synchronous copies and no thread: how CI checks it without a GPU.
    """

    def __init__(self, buffers: GradientBuffers, deliver: Callable[[int], None],
                 interrupt: Callable[[], None] = lambda: None, timeline=None,
                 groups: list[list[int]] | None = None):
        if not buffers.staged:
            raise ValueError("GradientStaging needs GradientBuffers built with staged=True (a host mirror)")
        self.buffers, self.deliver, self.interrupt, self.timeline = buffers, deliver, interrupt, timeline
        self.device = buffers.device
        self.cuda = self.device.type == "cuda"
        n = len(buffers.params)
        self.groups = [list(g) for g in (size_groups(buffers) if groups is None else groups)]
        self.group_of = [-1] * n
        for g, members in enumerate(self.groups):
            for i in members:
                self.group_of[i] = g
        if sorted(i for members in self.groups for i in members) != list(range(n)):
            raise ValueError(f"staging groups must hold every parameter index 0..{n - 1} once, got {self.groups}")
        self._ranges = [coalesce(buffers.segments, members) for members in self.groups]
        self._left = [len(members) for members in self.groups]  # gradients of each group still to come this step
        self._arrived: list[list[int]] = [[] for _ in self.groups]  # in hook order
        self.copies_to_host = self.copies_to_device = 0  # per-range copies issued (reported, tested)
        self.batches_to_host = 0  # groups sent: on a GPU, one event, one copy per range and one queue put each
        self.copies_as_averaged = 0  # of copies_to_device, those averaged() made as the exchange finished them
        # Whose average is still in the mirror only: each goes back once per step, so that what the
        # user does to .grad after synchronize() (clipping) is not overwritten by step()'s wait.
        self.outstanding = [False] * n
        # Those sent back early (averaged): per parameter, (the sequence number of the copy that took it, the index
        # of the event recorded after it), None if none.
        self._early: list[tuple[int, int] | None] = [None] * n
        self._sent_back = 0
        self._lock = threading.Lock()  # averaged() runs on the strategy's thread, to_device() on the training one
        if not self.cuda:
            return
        self.stream = torch.cuda.Stream(self.device)
        self.back_stream = torch.cuda.Stream(self.device)  # averaged()'s copies: not queued behind the gradients'
        # Per group, the streams that produced its gradients this step and an event for each (made as needed).
        self._streams: list[list] = [[] for _ in self.groups]
        self._produced: list[list] = [[] for _ in self.groups]
        # The staging thread's host waits on these: blocking, so that it sleeps instead of spinning a core.
        self.copied = [torch.cuda.Event(blocking=True) for _ in self.groups]  # group g's host copy complete
        self.returned = torch.cuda.Event()  # the last averaged values are back on the device (waited by streams)
        self.back = [torch.cuda.Event() for _ in range(n)]  # back[j]: averaged()'s copy whose last index is j
        # This copy only (synchronize releases the GIL), never the device; then the strategy gets the group.
        self.delivery = Delivery(lambda g, event: event.synchronize(), self._deliver_group, interrupt,
                                 setup=device_setup(self.device))

    # -- device -> host ------------------------------------------------------
    def to_host(self, i: int) -> None:
        """Parameter i's gradient is final on the device: once its group's are, copy them to the mirror, then
        deliver each (in hook order)."""
        self.outstanding[i] = True
        g = self.group_of[i]
        self._arrived[g].append(i)
        if self.cuda:
            # The hook runs on the thread and stream that produced the gradient (autograd's device thread).
            stream, seen = torch.cuda.current_stream(self.device), self._streams[g]
            if not seen or (seen[-1] != stream and stream not in seen):
                seen.append(stream)
        self._left[g] -= 1
        if self._left[g] == 0:
            self._left[g] = len(self.groups[g])  # for the next step
            self._send(g)

    def _send(self, g: int) -> None:
        """Group g's gradients are all final: one copy per range into the mirror, then delivered."""
        ranges, b = self._ranges[g], self.buffers
        self.copies_to_host += len(ranges)
        self.batches_to_host += 1
        if not self.cuda:
            for k, a, z in ranges:
                b.flats[k][a:z].copy_(b.device_flats[k][a:z])
            self._deliver_group(g)
            return
        streams, events = self._streams[g], self._produced[g]
        with torch.cuda.device(self.device):  # autograd's device thread, or the training thread (unsent gradients)
            while len(events) < len(streams):
                events.append(torch.cuda.Event())
            for stream, event in zip(streams, events):
                event.record(stream)
                self.stream.wait_event(event)
            streams.clear()
            with torch.cuda.stream(self.stream):
                for k, a, z in ranges:
                    b.flats[k][a:z].copy_(b.device_flats[k][a:z], non_blocking=True)
                self.copied[g].record(self.stream)
        self.delivery.put(g, self.copied[g])

    def _deliver_group(self, g: int) -> None:
        arrived, self._arrived[g] = self._arrived[g], []
        if self.timeline:
            self.timeline.instant(f"on host: {len(arrived)} params", "staging", track="staging", group=g)
        for i in arrived:
            self.deliver(i)

    def drain(self) -> None:
        """Block until every copied gradient has been delivered (in hook order); re-raise a delivery's error."""
        if self.cuda:
            self.delivery.drain()

    # -- host -> device ------------------------------------------------------
    def averaged(self, indices, ranges=None) -> None:
        """On the strategy's thread, as its exchange completes these parameters' averages in the mirror (and
        before any wait for them returns): their copies back to p.grad start now.

        ranges: (buffer, start, stop) of the mirror final now, copied instead of these parameters' segments (p3's
        slices: a large parameter goes back a few slices at a time, the copy of its last ones completing it; the
        strategy sends each range once a step, and all of a parameter's before naming it in `indices`)."""
        with self._lock:
            if ranges is None:
                indices, ranges = self._claim(indices)
            else:
                indices = self._mark(indices)
                self.copies_to_device += len(ranges)
            if not ranges:
                return
            self.copies_as_averaged += len(ranges)
            last = indices[-1] if indices else None
            if last is not None:
                self._sent_back += 1
                for i in indices:
                    self._early[i] = (self._sent_back, last)
            # Issued under the lock, so a to_device() that finds _early set finds the event recorded. A copy that
            # completes no parameter records nothing: the one that completes them runs after it on the stream.
            event = self.back[last] if self.cuda and last is not None else None
            self._put_back(ranges, self.back_stream if self.cuda else None, event)
        if self.timeline:
            self.timeline.instant(f"back to {self.device.type} as averaged: {len(indices)} params", "staging",
                                  track="staging", ranges=len(ranges))

    def _claim(self, indices) -> tuple[list[int], list]:
        """Those of these parameters whose average is still in the mirror only, marked as going back now, and
        their coalesced ranges (counted in copies_to_device). Under the lock."""
        indices = self._mark(indices)
        ranges = coalesce(self.buffers.segments, indices)
        self.copies_to_device += len(ranges)
        return indices, ranges

    def _mark(self, indices) -> list[int]:
        """Those of these parameters still outstanding, marked as back (or going back) now. Under the lock."""
        indices = [i for i in indices if self.outstanding[i]]
        for i in indices:
            self.outstanding[i] = False
        return indices

    def _put_back(self, ranges, stream, event) -> None:
        """Copy these ranges of the mirror into the device's gradients: on a CPU at once, else on `stream`
        (non-blocking, from pinned memory), recording `event` after them. On the model's device whichever
        thread calls (a progress thread set it already; the training thread's own current device is left as
        the user set it)."""
        b = self.buffers
        if not self.cuda:
            for k, a, z in ranges:
                b.device_flats[k][a:z].copy_(b.flats[k][a:z])
            return
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for k, a, z in ranges:
                b.device_flats[k][a:z].copy_(b.flats[k][a:z], non_blocking=True)
            if event is not None:
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

    def stop(self) -> None:
        """Before the strategy aborts: no more gradients handed over (Delivery.stop)."""
        if self.cuda:
            self.delivery.stop()

    def close(self) -> None:
        if self.cuda:
            self.delivery.close()
