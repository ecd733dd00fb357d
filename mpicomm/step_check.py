"""Per-step agreement through a coordinator, and an abort beacon that reaches every rank in any wait.

Every rank sends rank 0 a small fixed-size message at each synchronisation
point (a training step, a close): its action, step number, a digest of
settings that must match (hyper-parameters), a bitmap of the parameters it
used, and any problem it found (a NaN gradient). Rank 0 answers each rank
with one verdict: the OR of the bitmaps, or the error every rank raises. Like
Horovod's coordinator, rank 0 knows exactly which ranks have not arrived,
which is what its stall report names. Two messages per rank per step.

A rank that fails sends every other rank a beacon with its error; each rank
keeps a receive for it posted, and every wait of the runtime tests it
(`interrupt`), so the others stop within a poll wherever they wait.
"""

from __future__ import annotations

import zlib
from typing import Callable

import numpy as np
from mpi4py import MPI

from .agree import group_by_value
from .requests import RequestLog
from .stall import StallError, StallPolicy, wait_until
from .validate import CollectiveMismatchError

EXCHANGE, CLOSE = 1, 2
_ACTION = {EXCHANGE: "step", CLOSE: "close()"}
OK, ERROR, DESCRIBE, PROBLEM = 0, 1, 2, 3
TEXT = 240  # bytes of problem or error text a rank can send
REPLY_TEXT = 1500
_TAG_UP, _TAG_DOWN, _TAG_BEACON = 1, 2, 3


class PeerFailedError(RuntimeError):
    """Another rank stopped with an error; raised on the ranks that were waiting for it."""


class ReportedProblem(RuntimeError):
    """Some rank reported a problem with its step (text sent with EXCHANGE); raised on every rank, naming them."""


def digest(text: str) -> int:
    return zlib.crc32(text.encode())


class StepCheck:
    """One agreement round per synchronisation point, on a private duplicate of `comm`."""

    def __init__(self, comm: MPI.Comm, nbits: int, policy: StallPolicy | None = None, names=None):
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.policy = policy or StallPolicy.from_env()
        self.nbits = nbits
        self.names = names
        self._bitbytes = (nbits + 7) // 8
        self._msg = np.zeros(4 * 8 + self._bitbytes + TEXT, dtype=np.uint8)
        self._reply = np.zeros(2 * 8 + self._bitbytes + REPLY_TEXT, dtype=np.uint8)
        self._table = np.zeros((self.size, self._msg.size), dtype=np.uint8) if self.rank == 0 else None
        self.broken = False  # a round failed: no more rounds
        self.everyone_knows = False  # ...and every rank raised (or heard of) it: nobody to tell
        self._beacon_in = np.zeros(TEXT, dtype=np.uint8)
        self._beacon_log = RequestLog()
        self._beacon = self._beacon_log.irecv(self.comm, [self._beacon_in, MPI.BYTE], MPI.ANY_SOURCE, _TAG_BEACON) \
            if self.size > 1 else None

    def free(self) -> None:
        """Normal end only (every rank got here): a failed one keeps its communicator, see notify_failure."""
        self.stop_listening()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def stop_listening(self) -> None:
        """Cancel the beacon receive (a beacon arriving later stays unmatched on this never-freed communicator)."""
        self._beacon_log.cancel()
        self._beacon = None

    # -- failures ---------------------------------------------------------------------
    def interrupt(self) -> None:
        """Raise PeerFailedError if another rank has sent its failure beacon (cheap: one MPI_Test)."""
        if self._beacon is None:
            return
        status = MPI.Status()
        if self._beacon.Test(status):
            self._beacon = None
            self.broken = self.everyone_knows = True
            text = bytes(self._beacon_in[:status.Get_count(MPI.BYTE)]).decode(errors="replace")
            raise PeerFailedError(f"rank {status.Get_source()} stopped with {text}")

    def notify_failure(self, text: str, grace: float = 1.0) -> None:
        """This rank stops: tell every other rank, wherever it waits. Its messages are not waited for long."""
        self.broken = True
        if self.size == 1 or self.everyone_knows:
            return
        self.everyone_knows = True
        raw = np.frombuffer(text.encode()[:TEXT], dtype=np.uint8).copy()
        log = RequestLog()
        for r in range(self.size):
            if r != self.rank:
                log.isend(self.comm, [raw, MPI.BYTE], r, _TAG_BEACON)
        # Small messages leave at once (eager); after the grace period the sends are freed and
        # still delivered. The communicator is never freed after this (see DistributedOptimizer).
        log.cancel(grace)

    # -- one round --------------------------------------------------------------
    def run(self, action: int, step: int, settings: int, used: np.ndarray | None = None, text: str = "",
            describe: Callable[[], list[str]] | None = None, policy: StallPolicy | None = None) -> np.ndarray:
        """Agree with every rank; returns the OR over ranks of `used` (bools), or raises on every rank.

        text: a problem this rank found (every rank then raises ReportedProblem
        naming it). describe(): this rank's settings as "name=value" lines,
        gathered only when the `settings` digests differ, to name the values.
        """
        if self.broken:
            raise RuntimeError("an earlier agreement round failed: this object cannot be used any more")
        if self.size == 1:
            return np.asarray(used if used is not None else np.zeros(self.nbits, bool), dtype=bool)
        msg = self._msg
        msg[:] = 0
        msg[:32].view(np.int64)[:] = (action, step, settings, 0)
        if used is not None:
            msg[32:32 + self._bitbytes] = np.packbits(np.asarray(used, dtype=bool))
        raw = text.encode()[:TEXT]
        msg[:32].view(np.int64)[3] = len(raw)
        msg[32 + self._bitbytes:32 + self._bitbytes + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        policy = policy or self.policy
        try:
            if self.rank == 0:
                self._coordinate(step, policy)
            else:
                self._ask(step, policy)
        except (StallError, PeerFailedError):
            self.broken = True
            raise
        status = int(self._reply[:16].view(np.int64)[0])
        if status == DESCRIBE:
            self._name_differences(describe)
        if status in (ERROR, PROBLEM):
            self.broken = self.everyone_knows = True
            n = int(self._reply[:16].view(np.int64)[1])
            text = bytes(self._reply[16 + self._bitbytes:16 + self._bitbytes + n]).decode(errors="replace")
            raise {ERROR: CollectiveMismatchError, PROBLEM: ReportedProblem}[status](text)
        bits = np.unpackbits(self._reply[16:16 + self._bitbytes])[:self.nbits]
        return bits.astype(bool)

    def _ask(self, step: int, policy: StallPolicy) -> None:
        log = RequestLog()
        send = log.isend(self.comm, [self._msg, MPI.BYTE], 0, _TAG_UP)
        recv = log.irecv(self.comm, [self._reply, MPI.BYTE], 0, _TAG_DOWN)
        try:
            wait_until(lambda: MPI.Request.Testall([send, recv]), what=f"agreement on step {step}",
                       report=lambda: "no verdict from rank 0, which coordinates and names missing ranks",
                       policy=policy, who=f"rank {self.rank}: ", interrupt=self.interrupt)
        except (StallError, PeerFailedError):
            log.cancel()
            raise
        log.release()

    def _coordinate(self, step: int, policy: StallPolicy) -> None:
        log = RequestLog()
        table = self._table
        table[0] = self._msg
        recvs = [log.irecv(self.comm, [table[r], MPI.BYTE], r, _TAG_UP) for r in range(1, self.size)]

        def missing() -> str:
            # Testall leaves every request untouched unless all completed: ask each one.
            late = [r + 1 for r, req in enumerate(recvs) if not req.Test()]
            return f"rank(s) {late} have not reached this point (step {step}); the others wait for them"
        try:
            wait_until(lambda: MPI.Request.Testall(recvs), what=f"agreement on step {step}", report=missing,
                       policy=policy, who="rank 0: ", interrupt=self.interrupt)
        except (StallError, PeerFailedError):
            log.cancel()
            raise
        self._reply[:] = self._verdict()
        sends = [log.isend(self.comm, [self._reply, MPI.BYTE], r, _TAG_DOWN) for r in range(1, self.size)]
        wait_until(lambda: MPI.Request.Testall(sends), what="sending the verdict", policy=policy, who="rank 0: ",
                   interrupt=self.interrupt)
        log.release()

    # -- rank 0's verdict -------------------------------------------------------------
    def _verdict(self) -> np.ndarray:
        head = self._table[:, :32].view(np.int64)  # (size, 4): action, step, settings, text length
        reply = np.zeros_like(self._reply)
        bits = np.bitwise_or.reduce(self._table[:, 32:32 + self._bitbytes], axis=0)
        reply[16:16 + self._bitbytes] = bits
        problem, status = None, OK
        if (head[:, :2] != head[0, :2]).any():
            problem = "ranks are at different points: " + group_by_value(
                [f"{_ACTION.get(int(a), a)} #{int(s) + 1}" if a == EXCHANGE else f"{_ACTION.get(int(a), a)} after "
                 f"{int(s)} steps" for a, s in head[:, :2]])
        elif (head[:, 2] != head[0, 2]).any():
            status = DESCRIBE
        elif head[:, 3].any():
            problem, status = "; ".join(f"rank {r}: {self._text(r)}" for r in np.flatnonzero(head[:, 3])), PROBLEM
        if problem is not None:
            status = status or ERROR
            raw = problem.encode()[:REPLY_TEXT]
            reply[16:16 + self._bitbytes] = 0
            reply[16 + self._bitbytes:16 + self._bitbytes + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            reply[:16].view(np.int64)[1] = len(raw)
        reply[:16].view(np.int64)[0] = status
        return reply

    def _text(self, r: int) -> str:
        n = int(self._table[r, :32].view(np.int64)[3])
        start = 32 + self._bitbytes
        return bytes(self._table[r, start:start + n]).decode(errors="replace")

    def _name_differences(self, describe) -> None:
        """Rare path, every rank together: gather the settings as text and raise naming the differing ones."""
        self.broken = self.everyone_knows = True
        mine = describe() if describe is not None else []
        lists = self.comm.allgather(mine)  # failure path only: pickling is fine
        for i in range(max(len(x) for x in lists)):
            column = [x[i] if i < len(x) else "(missing)" for x in lists]
            if any(c != column[0] for c in column):
                raise CollectiveMismatchError(f"settings differ across ranks: {group_by_value(column)}")
        raise CollectiveMismatchError("settings differ across ranks (their digests differ)")
