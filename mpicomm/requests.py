"""The MPI requests this layer posted: error paths cancel and free them, tests count them, none outlives MPI."""

from __future__ import annotations

import threading
import time
import weakref

from mpi4py import MPI

_ACTIVE: set = set()  # logs holding requests that may still be in flight
_ABANDONED: list = []  # [owner, request, buffers]: collectives an error path dropped, completed later (abandon)
_DRAINED: dict = {}  # id -> a communicator whose leftover messages are received at exit (see drain_at_exit)
_LATE: weakref.WeakSet = weakref.WeakSet()  # owners whose join_late() runs at exit (see join_late_at_exit)
_FREED: list = []  # requests an error path freed while MPI may still use their buffers: kept to the end (cancel)
_LOCK = threading.Lock()  # error paths on progress threads abandon requests too


def live_requests() -> int:
    """Point-to-point requests posted through a RequestLog and neither completed, cancelled nor freed."""
    return sum(log.live() for log in list(_ACTIVE))


def left_posted() -> dict[str, list[int]]:
    """Per owner, [sends, receives] posted through RequestLogs and still in flight (empty when none is)."""
    found: dict[str, list[int]] = {}
    for log in list(_ACTIVE):
        sends, recvs = sum(1 for r in log.sends if r), sum(1 for r in log.recvs if r)
        if sends or recvs:
            counts = found.setdefault(log.owner, [0, 0])
            counts[0] += sends
            counts[1] += recvs
    return found


def cancel_all(grace: float = 1.0) -> None:
    """Cancel and free whatever every RequestLog still holds (shutdown's safety net, mpicomm.shutdown)."""
    for log in list(_ACTIVE):
        log.cancel(grace)


def cancel_receives(requests: list, grace: float = 1.0, statuses: list | None = None) -> list:
    """Cancel these receives and complete them; those still pending after `grace` seconds, for the caller to free.

    A cancelled receive completes at once; one that had already matched a message finishes receiving it. Either
    way it must be completed, but a peer that vanished mid-message must not hold this rank here. `statuses`
    (one per request) say which completed as cancelled and which received.
    """
    for req in requests:
        req.Cancel()
    deadline = time.monotonic() + grace
    pending = list(zip(requests, statuses or [None] * len(requests)))
    while pending and time.monotonic() < deadline:
        pending = [(r, s) for r, s in pending if not r.Test(s)]
        if pending:
            time.sleep(1e-4)
    return [r for r, _ in pending]


def abandon(request, owner: str, keep: tuple) -> None:
    """Error path for a non-blocking collective: MPI can neither cancel nor free one, so it is kept to be completed.

    A collective that every rank posted completes once MPI progresses, but its
    request must still be completed (tested) to be released: otherwise it is
    still posted at MPI_Finalize. Those abandoned earlier are tested here
    again, and mpicomm.shutdown waits a moment for the rest before MPI_Finalize.

    keep: the arrays MPI still reads or writes for it (or objects holding them), held here until it completes.
    The request does not hold them: mpi4py keeps no reference to the buffers of Iallreduce, Ireduce,
    Ireduce_scatter(_block), Iscan, Iexscan or Iallgatherv (tests/test_abandoned_mpi.py), so an owner
    that went away with its buffers would leave MPI writing into freed memory when the other ranks
    post theirs: a corrupted heap, and a crash later in whatever runs then.
    """
    if not request:
        return
    with _LOCK:
        for entry in _ABANDONED:
            if entry[1] is request:  # abandoned twice (a handle and its algorithm): the buffers of both stay
                entry[2] += tuple(keep)
                break
        else:
            _ABANDONED.append([owner, request, tuple(keep)])
        _ABANDONED[:] = [e for e in _ABANDONED if not e[1].Test()]


def join_late_at_exit(owner) -> None:
    """Have owner.join_late() run at exit, before abandoned collectives are finished: it may abandon more of them
    (a failed agreement joins the rounds that a failure notice which came after it stopped listening asks for)."""
    _LATE.add(owner)


def join_late() -> None:
    """Shutdown: let each owner registered with join_late_at_exit post what it owes."""
    for owner in list(_LATE):
        try:
            owner.join_late()
        except MPI.Exception:
            pass  # its communicator is gone: nothing of its rounds can complete, and the report says so


def abandoned() -> int:
    """Abandoned collectives not seen complete yet."""
    return len(abandoned_by())


def abandoned_by() -> list[str]:
    """The owner of each abandoned collective not seen complete yet (not tested here: a caller's look changes
    nothing)."""
    with _LOCK:
        return [o for o, r, _ in _ABANDONED if r]


def finish_abandoned(grace: float) -> list[str]:
    """Test abandoned collectives for up to `grace` seconds; the owners of those that never completed."""
    deadline = time.monotonic() + grace
    while True:
        with _LOCK:
            _ABANDONED[:] = [e for e in _ABANDONED if not e[1].Test()]
            if not _ABANDONED or time.monotonic() >= deadline:
                return [o for o, _, _ in _ABANDONED]
        time.sleep(1e-3)


def drain_at_exit(comm: MPI.Comm) -> MPI.Comm:
    """Mark a communicator of this layer's traffic: if it is still there at exit, what waits on it is received then.

    After a failure owners keep their communicators (never freed, see
    DistributedOptimizer), and peers' messages sent before they learnt of it
    (a ring chunk, a p3 slice, a beacon) arrive where nothing receives them any
    more: MPI_Finalize would find them unmatched.
    """
    for key in [k for k, c in _DRAINED.items() if c == MPI.COMM_NULL]:  # freed since: forget them
        del _DRAINED[key]
    _DRAINED[id(comm)] = comm
    return comm


def drain(limit: int = 1 << 16) -> int:
    """Receive and drop the small messages waiting on marked communicators (shutdown); how many it took.

    Larger messages stay: receiving one needs its sender, which may be gone.
    """
    taken, status = 0, MPI.Status()
    for comm in list(_DRAINED.values()):
        try:
            while comm != MPI.COMM_NULL and comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status) \
                    and status.Get_count(MPI.BYTE) <= limit:
                comm.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE], status.Get_source(), status.Get_tag())
                taken += 1
        except MPI.Exception:
            pass  # freed meanwhile through another handle: nothing of ours is left there
    return taken


class RequestLog:
    """Posts Isend/Irecv and remembers them; `cancel()` is the error path, `release()` the normal end.

    MPI keeps a receive that nobody completes alive until the communicator is
    freed, and it can match a later message with the same tag: so a failed
    exchange must cancel its receives, and free (MPI cannot cancel sends
    reliably) its sends, instead of dropping the Python objects. `owner` names
    the log in what shutdown reports about requests left posted at exit.
    """

    __slots__ = ("owner", "sends", "recvs", "__weakref__")

    def __init__(self, owner: str = "unnamed"):
        self.owner = owner
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
        pending = cancel_receives([r for r in self.recvs if r], grace)
        freed = pending + [r for r in self.sends if r]
        for req in freed:
            req.Free()
        # A freed request goes on: MPI may still read a send's buffer, or write a receive's, after this. mpi4py keeps
        # the buffer as long as the request object, which would go with these lists, and the memory with it (a large
        # buffer unmapped under MPI's feet: a crash later, in whatever runs next). So the objects stay to the end.
        with _LOCK:
            _FREED.extend(freed)
        self.release()
