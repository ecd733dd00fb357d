"""The hierarchy's node phases through an MPI-3 shared window: blocks copied and summed where they lie, never sent."""

#     rank l of a node of L ranks; round i of the node reduce-scatter, in half i % 2 of its slot:
#     1. the round's part of every block m != l into region m of that half      (its own segment)
#     2. Win_sync; a header to each node peer (its slot), and wait for theirs
#     3. Win_sync; add region l of each peer's half into its own block l, in the node ring's order (the same bits)
#     a round of the allgather: its block's part into its half, headers, each peer's part copied out
#     at the end: a zero-byte "done" to each peer and from each: no peer reads its slot any more
#
# Halves alternate round by round, so a peer's header of round i+1 says it has
# read round i's half: a rank writes that half again at round i+2 without any
# other message. A rank takes a free slot of its own segment when an allreduce's
# node phase starts; the slot is free again once every peer's done notice of
# that allreduce has come (tested when a later one looks for a slot, so no call
# waits for them). Allreduces in flight at once, started in any order, never
# wait on each other: where all SLOTS are held, a rank's header says MESSAGES
# and its parts go as messages after the headers (as the node ring sends them).
#
# Why: without a single-copy path (MPICH's CMA, off where Yama's ptrace_scope is
# not 0, as on Ubuntu), a large shared-memory message moves a cell per progress
# call, and a progress thread that sleeps between polls stretched wfbp's steps
# 1.6x at 4 hosts x 2 (benchmarks/topology.md). A header needs one progress call.

from __future__ import annotations

import threading

import numpy as np
from mpi4py import MPI

from .buffers import Buffer, offsets, reduce_into, typed_like
from .node_window import NOTICE
from .quiesce import quiesce
from .requests import cancel_receives
from .scratch import SCRATCH

__all__ = ["HALF_BYTES", "MESSAGES", "SLOTS", "NodeStage"]

SLOTS, HALF_BYTES = 4, 1 << 20  # a lane's window: 8 MiB a rank
MESSAGES = -1  # a header's slot when the rank's parts come as messages


class Call:
    """One allreduce (piece) on a stage: this rank's slot, its round count, the peers' headers."""

    __slots__ = ("slot", "rounds", "heads", "head")

    def __init__(self, slot: int, peers: int):
        self.slot, self.rounds = slot, 0
        self.heads = np.empty(peers, dtype=np.int32)
        self.head = np.array([slot], dtype=np.int32)


class NodeStage:
    """Shared-window slots over one node communicator: the hierarchy's node reduce-scatters and allgathers.

    A call: open(), then reduce_scatter and allgather steps (generators; the
    rounds count on through them), then close().

    Collective over `node` (every rank of it, the same `half_bytes`); raises
    MPI.Exception where the window cannot be allocated (the caller agrees on
    that across ranks, as mpicomm.node_window's callers do).
    """

    def __init__(self, node: MPI.Comm, half_bytes: int = HALF_BYTES):
        self.size, self.rank = node.Get_size(), node.Get_rank()
        self.peers = [q for q in range(self.size) if q != self.rank]
        self.region = max(64, half_bytes // self.size // 64 * 64)  # a block's part of a half: whole cache lines
        self.half = self.region * self.size
        self.win = self.notices = self.done = None
        # Per slot: None (free), True (a call's), or the done notices of the call that last held it, pending, as
        # (receives, sends): it is free once they complete, which open() tests, so that no call waits for them.
        self.held: list = [None] * SLOTS
        self.as_messages = 0  # calls that found every slot held (tests, reports)
        self._lock = threading.Lock()  # calls may open from the progress thread and the caller's
        self.win = MPI.Win.Allocate_shared(SLOTS * 2 * self.half, 1, comm=node)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch for the whole run: Win_sync needs one
        self.segments = [np.frombuffer(self.win.Shared_query(q)[0], dtype=np.uint8) for q in range(self.size)]
        self.notices, self.done = node.Dup(), node.Dup()  # the rounds' headers and messages; the done notices

    def open(self) -> Call:
        """A free slot of this rank's segment, or MESSAGES where all are held."""
        with self._lock:
            slot = next((s for s, h in enumerate(self.held) if h is None or h is not True and
                         MPI.Request.Testall(h[0] + h[1])), MESSAGES)
            if slot != MESSAGES:
                self.held[slot] = True
            else:
                self.as_messages += 1
        return Call(slot, len(self.peers))

    def reduce_scatter(self, call: Call, data: Buffer, counts: list[int], op: str, tag: int, log):
        """Generator: block `rank` of `counts` ends holding the node's reduction (op) in place in `data`."""
        offs, per, isz = offsets(counts), self.region // data.itemsize, data.itemsize
        for lo in range(0, max(counts, default=0), per):
            i, mine = call.rounds, self.segments[self.rank]
            parts = {m: self._part(offs, counts, m, lo, per) for m in range(self.size)}
            if call.slot != MESSAGES:
                for m in self.peers:
                    a, z = parts[m]
                    at = self._at(call.slot, i) + m * self.region
                    mine[at: at + (z - a) * isz] = data.bytes(a, z)
            heads = self._headers(call, tag, log)  # before any part sent as a message: each peer reads in this order
            sends = [log.isend(self.notices, data.bytes(*parts[m]), m, tag) for m in self.peers
                     if parts[m][0] < parts[m][1]] if call.slot == MESSAGES else []
            yield heads  # not the parts' sends: a large one completes once its peer, past its own headers, receives
            self.win.Sync()  # the peers' writes, as their headers say
            a, z = parts[self.rank]
            got = {q: SCRATCH.take(data, z - a) for j, q in enumerate(self.peers) if call.heads[j] == MESSAGES} \
                if a < z else {}
            if got or sends:
                yield sends + [log.irecv(self.notices, got[q].bytes(), q, tag) for q in got]
            if a >= z:
                continue
            # The node ring's order of operations: its partial sum starts at rank+1 and goes round, own part last.
            src = []
            for k in range(1, self.size):
                q = (self.rank + k) % self.size
                j = self.peers.index(q)
                src.append(got[q].elements() if q in got else
                           self._typed(q, self._at(int(call.heads[j]), i) + self.rank * self.region, z - a, data))
            own = data.elements(a, z)
            if len(src) == 1:
                reduce_into(op, own, own, src[0])
            else:
                acc = SCRATCH.take(data, z - a)
                total = acc.elements(0, z - a)
                total[...] = src[0]
                for more in src[1:]:
                    reduce_into(op, total, total, more)
                reduce_into(op, own, own, total)
                SCRATCH.give(acc)
            SCRATCH.give(*got.values())  # only here: a cancelled call may still have a receive posted into them

    def allgather(self, call: Call, data: Buffer, counts: list[int], tag: int, log):
        """Generator: every block m of `counts`, reduced on node rank m, copied into `data` on every rank."""
        offs, per, isz = offsets(counts), self.region // data.itemsize, data.itemsize
        for lo in range(0, max(counts, default=0), per):
            i = call.rounds
            a, z = self._part(offs, counts, self.rank, lo, per)
            if call.slot != MESSAGES:
                at = self._at(call.slot, i)
                self.segments[self.rank][at: at + (z - a) * isz] = data.bytes(a, z)
            heads = self._headers(call, tag, log)
            moving = [log.isend(self.notices, data.bytes(a, z), q, tag) for q in self.peers] \
                if call.slot == MESSAGES and a < z else []  # waited with the receives, as the reduce-scatter's
            yield heads
            self.win.Sync()
            for j, q in enumerate(self.peers):
                a, z = self._part(offs, counts, q, lo, per)
                if a >= z:
                    continue
                if call.heads[j] == MESSAGES:
                    moving.append(log.irecv(self.notices, data.bytes(a, z), q, tag))
                else:
                    at = self._at(int(call.heads[j]), i)
                    data.bytes(a, z)[...] = self.segments[q][at: at + (z - a) * isz]
            if moving:
                yield moving

    def close(self, call: Call, tag: int, log):
        """Generator: the done notices (this rank reads no peer's slot any more; each peer, none of its own). A
        call that held a slot leaves them pending with it, free once they complete; only one that sent its parts
        as messages waits for them."""
        done = ([log.irecv(self.done, NOTICE, q, tag) for q in self.peers],
                [log.isend(self.done, NOTICE, q, tag) for q in self.peers])
        if call.slot == MESSAGES:
            yield done[0] + done[1]
            return
        with self._lock:
            self.held[call.slot] = done

    def _drain(self) -> None:
        """free()'s clean path: the done notices still awaited are cancelled (a call a peer never closed sends
        none), then whatever the peers sent that nothing received is dropped (mpicomm.quiesce)."""
        held = [h for h in self.held if h is not None and h is not True]
        for req in cancel_receives([r for recvs, _ in held for r in recvs if r]):
            req.Free()  # matched but not landed: zero bytes into NOTICE, a global buffer
        quiesce([self.notices, self.done])
        for req in [r for _, sends in held for r in sends if r]:
            if not req.Test():
                req.Free()  # zero bytes from NOTICE

    def _headers(self, call: Call, tag: int, log) -> list:
        """A round's headers (this rank's slot), after a Win_sync that publishes its writes (MPI's unified memory
        model); the round counts on, so halves alternate through both phases."""
        call.rounds += 1
        self.win.Sync()
        reqs = [log.irecv(self.notices, call.heads[j:j + 1], q, tag) for j, q in enumerate(self.peers)]
        return reqs + [log.isend(self.notices, call.head, q, tag) for q in self.peers]

    def _at(self, slot: int, i: int) -> int:
        """Where round i's half of `slot` starts in a segment."""
        return (2 * slot + i % 2) * self.half

    @staticmethod
    def _part(offs, counts, m, lo, per) -> tuple[int, int]:
        """Elements [a, z) of block m in the round that starts `lo` elements into every block."""
        a = offs[m] + min(lo, counts[m])
        return a, offs[m] + min(lo + per, counts[m])

    def _typed(self, q: int, at: int, n: int, data: Buffer):
        return typed_like(self.segments[q][at: at + n * data.itemsize], data.flat)

    def free(self, clean: bool = True) -> None:
        """Collective over the node's ranks on the clean path (Win_free waits for them all); not `clean` (a peer may
        be gone), the window is left to the process's end, as freed requests are (mpicomm.requests).

        Calls cancelled here or on a peer (strategy.abort() before a clean close) may leave messages that nothing
        receives; the clean path drops them first (_drain), so that no later communicator is handed one."""
        if self.win is not None and clean:
            self._drain()
            self.segments = []
            self.win.Unlock_all()
            self.win.Free()
        self.win = None
        for comm in (self.notices, self.done):
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()
        self.notices = self.done = None
