"""Module buffers (BatchNorm running statistics) kept equal on every rank: averaged, or rank 0's, each step."""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from mpicomm.requests import abandon
from mpicomm.stall import StallPolicy, wait_until

from .trace import span_of

MODES = ("average", "broadcast", "none")


class BufferSync:
    """Averages (or broadcasts rank 0's) floating-point buffers after every step, off the critical path.

    Each rank's BatchNorm sees only its own samples, so its running mean and
    variance drift away from the others' and evaluation would differ by rank.
    `start()` (in step()) copies the buffers into a float64 staging vector and
    starts a non-blocking MPI allreduce (or broadcast); `finish()` (before the
    next forward pass, or before evaluation, checkpoints and close) writes the
    result back. "average" gives every rank the mean over ranks (a better
    estimate than any one rank's); "broadcast" is DDP's behaviour. Integer
    buffers (num_batches_tracked) advance alike on every rank and are left alone.
    """

    def __init__(self, model: torch.nn.Module, comm: MPI.Comm, mode: str, policy: StallPolicy, interrupt=None,
                 timeline=None):
        if mode not in MODES:
            raise ValueError(f"buffers must be one of {MODES}, got {mode!r}")
        self.mode, self.policy, self.interrupt, self.timeline = mode, policy, interrupt, timeline
        self.buffers = [b for b in model.buffers() if b.is_floating_point() and b.numel()] if mode != "none" else []
        self.size = comm.Get_size()
        # Its own communicator: after a failure the step agreement's collectives must be its alone
        # (mpicomm.step_check joins rounds that a failed rank left), and MPI matches them in order.
        self.comm = comm.Dup() if self.active else comm
        self.staging = np.zeros(sum(b.numel() for b in self.buffers), dtype=np.float64)
        self._views = np.split(self.staging, np.cumsum([b.numel() for b in self.buffers])[:-1]) if self.buffers else []
        self._request = None

    @property
    def active(self) -> bool:
        return bool(self.buffers) and self.size > 1

    def start(self) -> None:
        if not self.active:
            return
        self.finish()
        with torch.no_grad():
            for b, v in zip(self.buffers, self._views):
                v[:] = b.detach().reshape(-1).double().cpu().numpy()  # a GPU buffer: one host copy
        if self.mode == "average":
            self._request = self.comm.Iallreduce(MPI.IN_PLACE, self.staging)
        else:
            self._request = self.comm.Ibcast(self.staging, root=0)

    def finish(self) -> None:
        req = self._request
        if req is None:
            return
        # On the timeline: behind bulk traffic this wait can be long (benchmarks/claims.md, ninth pass).
        with span_of(self.timeline, "wait module buffers", "sync"):
            wait_until(req.Test, what="averaging module buffers", policy=self.policy,
                       who=f"rank {self.comm.Get_rank()}: ", report=lambda: "a native MPI allreduce of the buffers",
                       interrupt=self.interrupt)
        self._request = None
        scale = 1.0 / self.size if self.mode == "average" else 1.0
        with torch.no_grad():
            for b, v in zip(self.buffers, self._views):
                b.copy_(torch.from_numpy(v * scale).view(b.shape))

    def free(self) -> None:
        """Normal end only (a failed run keeps the communicator: its collective may still be in flight)."""
        if self.active:
            self.finish()  # every rank posted the last one (step() does, after the step's agreement)
            self.comm.Free()

    def abandon(self) -> None:
        """Error path: a collective cannot be cancelled; it is completed in the background (mpicomm.requests)."""
        abandon(self._request, "module buffers")
        self._request = None
