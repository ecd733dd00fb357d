"""Stage links on a GPU: boundary tensors cross MPI via preallocated pinned host buffers, copied on side streams."""

# Sending: an event is recorded on the compute stream after the tensor was
# produced, the device-to-host copy into a free host buffer is enqueued on the
# outbound side stream behind that event, and the Isend is posted once the
# copy's own event has completed (polled in every wait of the link, never a
# device-wide synchronize). Receiving: the Irecv lands in a host buffer of a
# ring; the host-to-device copy into the matching device buffer is enqueued
# non_blocking on the inbound side stream, behind an event marking that the
# stage's compute is done with that device buffer's previous micro-batch, and
# the compute stream (not the host) waits for the copy's event before using it.
#
# Neither waits on the host for a copy at a step's end: a thread of the link
# (Poster) sleeps on each outbound copy's event in turn and posts its Isend as
# soon as it completes, so a neighbour gets it even while this rank's caller
# blocks elsewhere (a barrier, a collective), and the host may run ahead of
# the device by more than a step. Without MPI_THREAD_MULTIPLE the Isends are
# posted by the link's polls instead, and the last copy of a step is waited
# for at its end. Every event the host (or that thread) synchronizes on is a
# blocking one: the waiting thread sleeps instead of spinning a core.
#
# The same bookkeeping runs on the CPU with separate host buffers and
# synchronous copies (every event complete at once), so CPU tests cover it:
# Pipeline(staging=True) or MPITRAIN_STAGING=force.

from __future__ import annotations

import threading
from collections import deque

import torch
from mpi4py import MPI

from mpicomm.progress import ABORT_JOIN, LOST_WAKEUP
from mpicomm.stall import wait_until

from .transport import TAG_ACTIVATION, TAG_GRADIENT, PipelineShapeError, StageLink, _bytes, describe


DEVICES = ("cpu", "cuda")


def stage_device(device, local_rank: int) -> torch.device:
    """The device a rank's stage runs on: cpu, or its GPU (local rank mod the GPUs it sees: ranks may share one)."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}") from None
    if d.type not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if d.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but torch sees no CUDA device (torch {torch.__version__})")
    index = d.index if d.index is not None else local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class _Done:
    """A CPU copy's stand-in for a CUDA event: the copy was synchronous, so the event is always complete."""

    __slots__ = ()

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


DONE = _Done()


class Copier:
    """Copies between the stage's device and host buffers, on a side stream of their own (CUDA) or at once (CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.host_waits = 0  # times the training thread waited on one of these copies (tests count them)

    def event(self):
        # Blocking: a host thread synchronizing on it sleeps until it completes instead of spinning a core.
        return torch.cuda.Event(blocking=True) if self.cuda else DONE

    def block(self, event) -> None:
        """The training thread waits for `event` (counted: the host stops running ahead of the device here)."""
        self.host_waits += 1
        event.synchronize()

    def mark(self, event) -> None:
        """Record `event` on the compute stream: it completes when what is queued there now has run."""
        if self.cuda:
            event.record(torch.cuda.current_stream(self.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after, done) -> None:
        """dst <- src on the side stream once `after` has completed; `done` completes with the copy."""
        with torch.no_grad():  # dst may be a leaf that requires grad (a received activation), src part of a graph
            if not self.cuda:
                dst.copy_(src)
                return
            self.stream.wait_event(after)
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
            done.record(self.stream)

    def wait(self, event) -> None:
        """The compute stream, not the host, waits for `event` before the work queued after this."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(event)

    def host(self, meta) -> torch.Tensor:
        """A host buffer of a boundary's (shape, dtype): pinned for a GPU (DMA straight from the device)."""
        return torch.empty(meta[0], dtype=meta[1], pin_memory=self.cuda)


class _Inbox:
    """One direction's receives: a ring of host buffers MPI writes into, and the device buffers the stage uses."""

    def __init__(self, copier: Copier, host: list[torch.Tensor], requests: dict, meta, source: int, tag: int,
                 what: str):
        self.host, self.requests, self.source, self.tag, self.what = host, requests, source, tag, what
        self.device = [torch.empty(meta[0], dtype=meta[1], device=copier.device) for _ in host]
        self.landed = [copier.event() for _ in host]  # the copy out of host[s] into device[s] is done
        self.free = [copier.event() for _ in host]  # the compute stream is done with device[s]
        self.ahead: int | None = None  # a receive posted later: its host buffer was still being copied out


class _Slot:
    """A host buffer for one outgoing message: copied into on the device's side stream, then sent."""

    __slots__ = ("host", "done", "tag", "dest", "source", "request")

    def __init__(self, host: torch.Tensor, done, tag: int):
        self.host, self.done, self.tag = host, done, tag
        self.dest = self.source = self.request = None


class Poster:
    """A thread that posts each staged send's Isend as soon as its copy is done, sleeping on the copy's event."""

    def __init__(self, link: "StagedLink"):
        self.link = link
        self.queue: deque[_Slot] = deque()  # copies queued, Isend not posted yet (in the order sent)
        self._posted: list[_Slot] = []  # posted since the link last took them
        self.error: BaseException | None = None
        self._lock = threading.RLock()  # entered itself, never through the Condition (mpicomm.progress.ABORT_JOIN)
        self._cv = threading.Condition(self._lock)
        self._stop = self._abort = False
        self._thread = threading.Thread(target=self._run, name=f"pipeline stage {link.stage} sends", daemon=True)
        self._thread.start()

    def put(self, slot: _Slot) -> None:
        with self._lock:
            self.queue.append(slot)
            self._cv.notify()

    def _run(self) -> None:
        link = self.link
        try:
            if link.device.type == "cuda":
                torch.cuda.set_device(link.device)  # this thread's CUDA calls on the stage's GPU, not GPU 0
            while True:
                with self._lock:
                    while not self.queue and not self._stop:
                        self._cv.wait(LOST_WAKEUP)  # timed: see mpicomm.progress.LOST_WAKEUP
                    if self._abort or not self.queue:
                        return
                    slot = self.queue[0]
                slot.done.synchronize()  # one stream: copies complete in order
                with self._lock:
                    if self._abort:
                        return
                    slot.request = link.log.isend(link.comm, _bytes(slot.host), slot.dest, slot.tag)
                    self.queue.popleft()
                    self._posted.append(slot)
        except BaseException as exc:  # raised on the training thread by its next poll
            self.error = exc

    def take(self) -> list[_Slot]:
        """The slots posted since the last call; raises what stopped the thread, if anything did."""
        with self._lock:
            out, self._posted = self._posted, []
        if self.error is not None:
            raise self.error
        return out

    def stop(self, abort: bool = False) -> None:
        """End the thread: after posting what is queued, or at once (abort: the link cancels its requests)."""
        with self._lock:
            self._stop, self._abort = True, abort
            self._cv.notify_all()
        self._thread.join(ABORT_JOIN if abort else None)  # the error path does not wait for a stuck thread


class StagedLink(StageLink):
    """A StageLink for a stage whose tensors live on `device`: everything crosses through host buffers."""

    def __init__(self, comm, stage: int, in_meta, out_meta, in_flight: int, device, interrupt=None, policy=None,
                 timeline=None):
        self.device = torch.device(device)
        self.inbound, self.outbound = Copier(self.device), Copier(self.device)  # two streams: both ways at once
        super().__init__(comm, stage, in_meta, out_meta, in_flight, interrupt, policy, timeline)
        self._in: dict[int, _Inbox] = {}
        if self.prev is not None:
            self._in[TAG_ACTIVATION] = _Inbox(self.inbound, self._acts, self._act_req, in_meta, self.prev,
                                              TAG_ACTIVATION, "activation")
        if self.next is not None:
            self._in[TAG_GRADIENT] = _Inbox(self.inbound, self._grads, self._grad_req, out_meta, self.next,
                                            TAG_GRADIENT, "gradient")
        # Outgoing: activations to the next stage (out_meta), gradients to the previous one (in_meta).
        self._out_meta = {TAG_ACTIVATION: out_meta, TAG_GRADIENT: in_meta}
        self._pools: dict[int, list[_Slot]] = {
            TAG_ACTIVATION: [self._slot(TAG_ACTIVATION) for _ in range(in_flight + 1)] if self.next is not None
            else [],
            TAG_GRADIENT: [self._slot(TAG_GRADIENT) for _ in range(2)] if self.prev is not None else []}
        self._after = self.outbound.event()  # reused: a stream's wait takes the event as it is when asked
        self._staging: deque[_Slot] = deque()  # without a Poster: copies queued, Isend not posted yet
        self._posted: list[_Slot] = []  # Isend posted, not known complete
        sends = bool(self._pools[TAG_ACTIVATION] or self._pools[TAG_GRADIENT])
        self._poster = Poster(self) if sends and MPI.Query_thread() == MPI.THREAD_MULTIPLE else None
        self.host_buffers = sum(len(p) for p in self._pools.values())  # grows only if every one is in use

    def _buffer(self, meta) -> torch.Tensor:
        return self.inbound.host(meta)

    def _slot(self, tag: int) -> _Slot:
        return _Slot(self.outbound.host(self._out_meta[tag]), self.outbound.event(), tag)

    # -- receives -------------------------------------------------------------------------
    def activation(self, micro: int) -> torch.Tensor:
        return self._receive(self._in[TAG_ACTIVATION], micro)

    def gradient(self, micro: int) -> torch.Tensor:
        return self._receive(self._in[TAG_GRADIENT], micro)

    def _post_into(self, box: _Inbox, micro: int, must: bool) -> None:
        if micro in box.requests:
            return
        s = micro % len(box.host)
        if not box.landed[s].query():  # MPI must not write into a host buffer still being copied out
            if not must:
                box.ahead = micro  # posted by a later poll
                return
            self.inbound.block(box.landed[s])  # this one buffer's copy, needed now (rare: the ring is 2 deep or more)
        box.ahead = None
        box.requests[micro] = self.log.irecv(self.comm, _bytes(box.host[s]), box.source, box.tag)

    def _receive(self, box: _Inbox, micro: int) -> torch.Tensor:
        """Micro-batch `micro`'s tensor on the device; the compute stream waits for its copy, the host does not."""
        self._post_into(box, micro, must=True)
        self._wait(box.requests.pop(micro), f"{box.what} of micro-batch {micro} from stage {box.source}")
        s = micro % len(box.host)
        self.inbound.copy(box.device[s], box.host[s], box.free[s], box.landed[s])
        self.inbound.wait(box.landed[s])
        self._post_into(box, micro + 1, must=False)
        return box.device[s]

    def release(self, micro: int) -> None:
        """Mark on the compute stream: micro-batch `micro`'s device buffers may be overwritten once it gets here."""
        for box in self._in.values():
            self.inbound.mark(box.free[micro % len(box.host)])

    # -- sends -------------------------------------------------------------------------------
    def _send(self, t: torch.Tensor, dest: int, tag: int, micro: int) -> None:
        meta = self._out_meta[tag]
        if tuple(t.shape) != tuple(meta[0]) or t.dtype != meta[1]:
            raise PipelineShapeError(f"stage {self.stage} sends {describe(t.shape, t.dtype)} to stage {dest}; the "
                                     f"boundary was agreed as {describe(meta[0], meta[1])} at the first step")
        slot = self._free_slot(tag)
        self.outbound.mark(self._after)
        self.outbound.copy(slot.host, t.detach(), self._after, slot.done)
        # Holding the tensor keeps the caching allocator from handing its memory out before the copy has run.
        slot.source, slot.dest = t, dest
        if self._poster is not None:
            self._poster.put(slot)
        else:
            self._staging.append(slot)
        nbytes = t.numel() * t.element_size()
        self.bytes_sent += nbytes
        self.messages_sent += 1
        if self.timeline:
            self.timeline.instant(f"send {'act' if tag == TAG_ACTIVATION else 'grad'} {micro}", "pipeline",
                                  track="comm", bytes=nbytes, to=dest)
        self._poll()

    def _free_slot(self, tag: int) -> _Slot:
        pool = self._pools[tag]
        if not pool:
            self._poll()
        if pool:
            return pool.pop()
        # Every buffer is still on its way: one more (a neighbour slow to receive; the pool keeps it).
        self.host_buffers += 1
        return self._slot(tag)

    def _poll(self) -> None:
        """Post the Isends whose copies are done (in order), recycle delivered buffers, post deferred receives."""
        if self._poster is not None:
            self._posted += self._poster.take()
        while self._staging and self._staging[0].done.query():  # one stream: copies complete in order
            slot = self._staging.popleft()
            slot.request = self.log.isend(self.comm, _bytes(slot.host), slot.dest, slot.tag)
            self._posted.append(slot)
        if self._posted:
            pending = []
            for slot in self._posted:
                if slot.request.Test():
                    slot.request = slot.source = None  # the copy has run: the tensor's memory may be reused
                    self._pools[slot.tag].append(slot)
                else:
                    pending.append(slot)
            self._posted = pending
        for box in self._in.values():
            if box.ahead is not None:
                self._post_into(box, box.ahead, must=False)

    def post_sends(self) -> None:
        """At a step's end, every send handed to MPI: a neighbour may need them while this rank's caller blocks
        elsewhere (a barrier, a collective). The Poster does it as each copy completes; without one, the host
        waits here for the step's last copy."""
        if self._staging:
            self.outbound.block(self._staging[-1].done)  # the last copy of the stream: all before it are done too
        self._poll()

    def flush_sends(self) -> None:
        self.post_sends()
        if self._poster is not None:
            poster = self._poster
            wait_until(lambda: (self._poll(), not poster.queue)[1], what=f"stage {self.stage}: sends to be copied "
                       "out of the device", policy=self.policy, interrupt=self.interrupt)
        while self._posted:
            self._wait(self._posted[0].request, "a send to a neighbouring stage to be received")
            self._poll()
        super().flush_sends()  # evaluation's sends

    # -- evaluation: not the training path, a synchronous copy per batch ----------------------------
    def send_eval(self, out: torch.Tensor):
        return super().send_eval(out.detach().to("cpu"))

    def recv_eval(self, shape, dtype) -> torch.Tensor:
        return super().recv_eval(shape, dtype).to(self.device)

    # -- failing and ending -------------------------------------------------------------------
    def _forget(self, abort: bool) -> None:
        if self._poster is not None:
            self._poster.stop(abort)
            self._poster = None
        self._staging.clear()
        self._posted = []
        for box in self._in.values():
            box.requests.clear()
            box.ahead = None

    def cancel(self) -> None:
        self._forget(abort=True)  # the thread first: it must post nothing while the requests are cancelled
        super().cancel()

    def close(self) -> None:
        self.flush_sends()
        self._forget(abort=False)
        super().close()
