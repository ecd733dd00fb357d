"""The MPI requests this layer has posted, so that error paths cancel and free them and tests can count them."""

from __future__ import annotations

import time

from mpi4py import MPI

_ACTIVE: set = set()  # logs holding requests that may still be in flight


def live_requests() -> int:
    """Point-to-point requests posted through a RequestLog and neither completed, cancelled nor freed."""
    return sum(log.live() for log in list(_ACTIVE))


class RequestLog:
    """Posts Isend/Irecv and remembers them; `cancel()` is the error path, `release()` the normal end.

    MPI keeps a receive that nobody completes alive until the communicator is
    freed, and it can match a later message with the same tag: so a failed
    exchange must cancel its receives, and free (MPI cannot cancel sends
    reliably) its sends, instead of dropping the Python objects.
    """

    __slots__ = ("sends", "recvs", "__weakref__")

    def __init__(self):
        self.sends: list = []
        self.recvs: list = []

    def isend(self, comm: MPI.Comm, buf, dest: int, tag: int) -> MPI.Request:
        req = comm.Isend(buf, dest, tag)
        self.sends.append(req)
        _ACTIVE.add(self)
        return req

    def irecv(self, comm: MPI.Comm, buf, source: int, tag: int) -> MPI.Request:
        req = comm.Irecv(buf, source, tag)
        self.recvs.append(req)
        _ACTIVE.add(self)
        return req

    def live(self) -> int:
        return sum(1 for r in self.sends if r) + sum(1 for r in self.recvs if r)

    def release(self) -> None:
        """Forget completed requests (the owner saw them all complete)."""
        self.sends, self.recvs = [], []
        _ACTIVE.discard(self)

    def cancel(self, grace: float = 1.0) -> None:
        """Cancel pending receives and free pending sends; never blocks for longer than `grace` seconds."""
        for req in self.recvs:
            if req:
                req.Cancel()
        deadline = time.monotonic() + grace
        pending = [r for r in self.recvs if r]
        # A cancelled receive completes at once; one that had already matched a message finishes
        # receiving it. Either way it must be completed, but a peer that vanished mid-message
        # must not hold this rank here: after the grace period the request is freed instead.
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if not r.Test()]
            if pending:
                time.sleep(1e-4)
        for req in pending + [r for r in self.sends if r]:
            req.Free()
        self.release()
