"""Stage-to-stage transport: activations to the next stage, gradients back, as Isend/Irecv on preallocated buffers."""

# Each boundary carries one tensor of a shape and dtype agreed once at start
# (`agree_boundaries`), so messages are raw bytes with no header. Receives are
# posted ahead, into a ring of buffers as deep as the micro-batches the stage
# holds in flight, so data lands while the stage computes; sends leave at once
# and are completed lazily. Messages between two ranks with one tag arrive in
# the order sent (MPI's non-overtaking rule), which is the schedule's order,
# so a tag per direction is all the matching needed.
#
# This link sends and receives CPU tensors in place. Stages on a GPU use
# runtime.pipeline.staging.StagedLink, which crosses through host buffers.

from __future__ import annotations

import time

import numpy as np
import torch
from mpi4py import MPI

from mpicomm.agree import fail_together
from mpicomm.requests import RequestLog
from mpicomm.stall import StallPolicy, wait_until
from mpicomm.tags import check_tag

from .host_times import SAMPLES, snapshot

TAG_ACTIVATION, TAG_GRADIENT, TAG_EVAL = 11, 12, 13
_MAX_DIMS = 8
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64]


class PipelineShapeError(ValueError):
    """A boundary between stages that cannot carry what the stages produce or expect."""


DEVICE_TYPES = ("cpu", "cuda")


def _bytes(t: torch.Tensor):
    """An MPI byte buffer over a contiguous tensor of any dtype (numpy has no bfloat16: view it as bytes)."""
    if t.device.type != "cpu":  # MPI reads host memory: a GPU tensor must be staged (StagedLink)
        raise PipelineShapeError(f"a {t.device} tensor cannot be sent as it is: stages on a GPU cross through "
                                 "host buffers (runtime.pipeline.staging.StagedLink)")
    return [t.detach().view(-1).view(torch.uint8).numpy(), MPI.BYTE]


def describe(shape, dtype) -> str:
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"


def agree_boundaries(comm: MPI.Comm, stage: int, produce, device_type: str = "cpu") -> list[tuple]:
    """Every stage's output (shape, dtype, device type), on every rank, stage by stage (start-up only).

    produce(in_meta) is called on stage k's rank with stage k-1's output meta
    (None on stage 0) and returns this stage's output tensor (a forward on
    zeros). A stage that fails (its layers cannot take the previous stage's
    output, return something that is not one tensor, or return it on another
    device than the stage's `device_type`), and stages on different device
    types, are named on every rank.
    """
    stages = comm.Get_size()
    metas: list[tuple] = []
    row = np.zeros(3 + _MAX_DIMS, dtype=np.int64)
    for k in range(stages):
        problem = None
        if k == stage:
            try:
                out = produce(metas[-1] if metas else None)
                if not isinstance(out, torch.Tensor):
                    raise PipelineShapeError(f"stage {k} returns a {type(out).__name__}; a boundary between stages "
                                             "carries one tensor: wrap the layers so they return one")
                if out.dim() > _MAX_DIMS or out.dtype not in _DTYPES:
                    raise PipelineShapeError(f"stage {k} returns {describe(out.shape, out.dtype)}: a boundary "
                                             f"carries up to {_MAX_DIMS} dimensions of {_DTYPES}")
                if out.device.type != device_type:
                    raise PipelineShapeError(f"stage {k} runs on {device_type} but its layers return a tensor on "
                                             f"{out.device}: keep the stage's output on the stage's device")
                row[:] = 0
                row[0], row[1], row[2] = _DTYPES.index(out.dtype), out.dim(), DEVICE_TYPES.index(device_type)
                row[3:3 + out.dim()] = out.shape
            except Exception as exc:  # any error in the user's layers: every rank must hear of it
                problem = f"stage {k}: {type(exc).__name__}: {exc}"
        fail_together(comm, problem, PipelineShapeError)
        comm.Bcast(row, root=k)
        metas.append((tuple(int(d) for d in row[3:3 + row[1]]), _DTYPES[int(row[0])], DEVICE_TYPES[int(row[2])]))
    kinds = {m[2] for m in metas}
    if len(kinds) > 1:  # the same on every rank: all raise together
        raise PipelineShapeError("stages on different device types: " + ", ".join(
            f"stage {k} on {m[2]}" for k, m in enumerate(metas)) + "; give every rank the same device")
    return metas


class StageLink:
    """One stage's messages: activations in from the previous stage and out to the next, gradients the other way."""

    def __init__(self, comm: MPI.Comm, stage: int, in_meta, out_meta, in_flight: int,
                 interrupt=None, policy: StallPolicy | None = None, timeline=None):
        self.comm, self.stage = comm, stage
        self.stages = comm.Get_size()
        self.prev = stage - 1 if stage > 0 else None
        self.next = stage + 1 if stage < self.stages - 1 else None
        self.interrupt, self.policy, self.timeline = interrupt, policy or StallPolicy.from_env(), timeline
        for tag in (TAG_ACTIVATION, TAG_GRADIENT, TAG_EVAL):
            check_tag(comm, tag)
        self.log = RequestLog("pipeline stage link")
        self.bytes_sent = self.messages_sent = 0
        # Seconds each send held this stage's host (a copy out of the output, the Isend's own copy and calls):
        # what a simulator adds after each op that sends (runtime.sim.pipeline's send_host).
        self.send_seconds: dict[str, list[float]] = {"act": [], "grad": []}
        # Inputs stay alive until their backward (they are autograd leaves): one buffer per micro-batch
        # in flight, plus the one being received ahead.
        self._acts = [self._buffer(in_meta) for _ in range(in_flight + 1)] if self.prev is not None else []
        self._act_req: dict[int, MPI.Request] = {}
        # A gradient is consumed by its backward at once: one in use, one arriving.
        self._grads = [self._buffer(out_meta) for _ in range(2)] if self.next is not None else []
        self._grad_req: dict[int, MPI.Request] = {}
        self._sends: list[tuple[MPI.Request, torch.Tensor]] = []

    def _buffer(self, meta) -> torch.Tensor:
        """A receive buffer of a boundary's (shape, dtype): where MPI writes."""
        return torch.empty(meta[0], dtype=meta[1])

    # -- receives -----------------------------------------------------------------------
    def _post(self, table, buffers, micro, source, tag):
        if micro not in table:
            buf = buffers[micro % len(buffers)]
            table[micro] = self.log.irecv(self.comm, _bytes(buf), source, tag)

    def _take(self, table, buffers, micro: int, source: int, tag: int, what: str) -> torch.Tensor:
        """Micro-batch `micro`'s tensor from a neighbour; the receive of the next one is posted at once."""
        self._post(table, buffers, micro, source, tag)
        self._wait(table.pop(micro), f"{what} of micro-batch {micro} from stage {source}")
        self._post(table, buffers, micro + 1, source, tag)  # another buffer: there are at least two
        return buffers[micro % len(buffers)]

    def activation(self, micro: int) -> torch.Tensor:
        """Micro-batch `micro`'s input, from the previous stage."""
        return self._take(self._act_req, self._acts, micro, self.prev, TAG_ACTIVATION, "activation")

    def gradient(self, micro: int) -> torch.Tensor:
        """The gradient of micro-batch `micro`'s output, from the next stage."""
        return self._take(self._grad_req, self._grads, micro, self.next, TAG_GRADIENT, "gradient")

    # -- sends ---------------------------------------------------------------------------
    def send_activation(self, micro: int, out: torch.Tensor) -> None:
        self._timed_send(out, self.next, TAG_ACTIVATION, micro, self.send_seconds["act"])

    def send_gradient(self, micro: int, grad: torch.Tensor) -> None:
        self._timed_send(grad, self.prev, TAG_GRADIENT, micro, self.send_seconds["grad"])

    def _timed_send(self, t: torch.Tensor, dest: int, tag: int, micro: int, times: list[float]) -> None:
        start = time.perf_counter()
        self._send(t, dest, tag, micro)
        if len(times) < SAMPLES:
            times.append(time.perf_counter() - start)

    def send_times(self, clear: bool = False) -> dict[str, list[float]]:
        """The host seconds of each send since the last clear, by direction ("act", "grad"); clear: start anew."""
        return snapshot(self.send_seconds, clear)

    def _send(self, t: torch.Tensor, dest: int, tag: int, micro: int) -> None:
        t = t.detach().contiguous()  # kept referenced below until MPI is done with it
        req = self.log.isend(self.comm, _bytes(t), dest, tag)
        self._sends.append((req, t))
        self.bytes_sent += t.numel() * t.element_size()
        self.messages_sent += 1
        if self.timeline:
            self.timeline.instant(f"send {'act' if tag == TAG_ACTIVATION else 'grad'} {micro}", "pipeline",
                                  track="comm", bytes=t.numel() * t.element_size(), to=dest)
        if len(self._sends) > 4:
            self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def release(self, micro: int) -> None:
        """The stage is done with micro-batch `micro`'s received tensors (its backward is queued): nothing to do."""

    def post_sends(self) -> None:
        """Every send handed to MPI (a step's end): here they all are already."""

    def flush_sends(self) -> None:
        """Wait until every send has been delivered (before the buffers or the communicator go)."""
        for req, _ in self._sends:
            self._wait(req, "a send to a neighbouring stage to be received")
        self._sends = []

    # -- evaluation: variable batch sizes, same per-sample shape ----------------------------
    def send_eval(self, out: torch.Tensor) -> MPI.Request:
        out = out.detach().contiguous()
        req = self.log.isend(self.comm, _bytes(out), self.next, TAG_EVAL)
        self._sends.append((req, out))
        return req

    def recv_eval(self, shape, dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype)
        self._wait(self.log.irecv(self.comm, _bytes(buf), self.prev, TAG_EVAL), "an evaluation batch")
        return buf

    # -- waiting and failing ---------------------------------------------------------------
    def _poll(self) -> None:
        """Called in every wait: work that moves on without this rank's compute (StagedLink: staged sends)."""

    def _wait(self, req: MPI.Request, what: str) -> None:
        if req.Test():
            return
        # The span carries what it waits for ("activation of micro-batch 3 from stage 1"): a reader matches it
        # to its send.
        span = self.timeline.begin(f"wait {what.split(' of ')[0]}", "pipeline", track="comm", waits_for=what) \
            if self.timeline else None

        def done() -> bool:
            self._poll()
            return req.Test()
        wait_until(done, what=f"stage {self.stage}: {what}", policy=self.policy, interrupt=self.interrupt,
                   report=lambda: "the neighbouring stage has not sent it (is it still running?)")
        if span is not None:
            self.timeline.end(span)

    def cancel(self) -> None:
        """Error path: cancel the receives posted ahead, free the sends."""
        self.log.cancel()
        self._act_req, self._grad_req, self._sends = {}, {}, []

    def close(self) -> None:
        """Normal end: nothing may be pending but receives posted ahead for micro-batches that never came."""
        self.flush_sends()
        self.log.cancel()
        self._act_req, self._grad_req = {}, {}
