"""Stage links for stages on a GPU: boundary tensors cross MPI through preallocated pinned host buffers, copied on side streams.

Sending: an event is recorded on the compute stream after the tensor was
produced, the device-to-host copy into a free host buffer is enqueued on the
outbound side stream behind that event, and the Isend is posted once the
copy's own event has completed (polled in every wait of the link, never a
device-wide synchronize). Receiving: the Irecv lands in a host buffer of a
ring; the host-to-device copy into the matching device buffer is enqueued
non_blocking on the inbound side stream, behind an event marking that the
stage's compute is done with that device buffer's previous micro-batch, and
the compute stream (not the host) waits for the copy's event before using it.

The same bookkeeping runs on the CPU with separate host buffers and
synchronous copies (every event complete at once), so CPU tests cover it:
Pipeline(staging=True) or MPITRAIN_STAGING=force.
"""

from __future__ import annotations

from collections import deque

import torch

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

    def event(self):
        return torch.cuda.Event() if self.cuda else DONE

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
        self._staging: deque[_Slot] = deque()  # copies queued, Isend not posted yet (in the order sent)
        self._posted: list[_Slot] = []  # Isend posted, not known complete
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
            box.landed[s].synchronize()  # this one buffer's copy, needed now (rare: the ring is two deep or more)
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
        while self._staging and self._staging[0].done.query():  # one stream: copies complete in order
            slot = self._staging.popleft()
            slot.source = None
            slot.request = self.log.isend(self.comm, _bytes(slot.host), slot.dest, slot.tag)
            self._posted.append(slot)
        if self._posted:
            pending = []
            for slot in self._posted:
                if slot.request.Test():
                    slot.request = None
                    self._pools[slot.tag].append(slot)
                else:
                    pending.append(slot)
            self._posted = pending
        for box in self._in.values():
            if box.ahead is not None:
                self._post_into(box, box.ahead, must=False)

    def post_sends(self) -> None:
        """Every send handed to MPI, waiting for the last copy (at a step's end: a neighbour may need them while
        this rank's caller blocks elsewhere, in a barrier or a collective)."""
        if self._staging:
            self._staging[-1].done.synchronize()  # the last copy of the stream: all before it are done too
            self._poll()

    def flush_sends(self) -> None:
        self.post_sends()
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
    def _forget(self) -> None:
        self._staging.clear()
        self._posted = []
        for box in self._in.values():
            box.requests.clear()
            box.ahead = None

    def cancel(self) -> None:
        super().cancel()
        self._forget()

    def close(self) -> None:
        super().close()
        self._forget()
