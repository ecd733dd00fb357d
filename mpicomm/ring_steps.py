"""The ring's pipelined steps over one Ring's communicator: reduce-scatter steps, then allgather steps."""

# At step t rank r sends block (r-t-1) mod P to its right and receives block
# (r-t-2) mod P from its left, the block it forwards at step t+1. P = 3:
#
#     step  rank 0        rank 1        rank 2
#     t=0   2 ->  <- 1    0 ->  <- 2    1 ->  <- 0     reduce: what arrives is added to this rank's block
#     t=1   1+ -> <- 0+   2+ -> <- 1+   0+ -> <- 2+    (+ a partial sum); block r is now whole on rank r
#     t=2   0* -> <- 2*   1* -> <- 0*   2* -> <- 1*    gather: what arrives is final (*)
#     t=3   2* -> <- 1*   0* -> <- 2*   1* -> <- 0*
#
# Steps 0..P-2 are a reduce-scatter, P-1..2P-3 an allgather, both an
# allreduce. Each block moves in chunks, and a chunk is forwarded the moment it
# is reduced, so reducing one chunk overlaps receiving the next.

from __future__ import annotations

from mpi4py import MPI

from .buffers import Buffer, chunk_ranges, offsets, reduce_into
from .scratch import SCRATCH

__all__ = ["ring_steps"]


def ring_steps(ring, data: Buffer, counts, steps: range, op, tag, log, out: Buffer | None = None):
    """Generator: run steps `steps` of `ring` (a mpicomm.Ring) over `data` split into blocks `counts`.

    With `out` (reduce-scatter only) `data` is never written: partial sums
    live in rotating scratch blocks and the last step writes into `out`.
    """
    P, r = ring.size, ring.rank
    if P == 1 or not steps:
        return
    offs = offsets(counts)
    per = max(1, ring.chunk_bytes // data.itemsize)
    reduce_phase = P - 1
    last = steps[-1]
    nscratch = 3 if out is not None else 2
    # Only the blocks some reducing step uses: a 2-rank ring reduces once, and these are large (1/P of the data).
    used = {t % nscratch for t in steps if t < reduce_phase}
    scratch = [SCRATCH.take(data, max(counts)) if k in used else None for k in range(nscratch)] if used else []
    busy = [[] for _ in scratch]  # sends still reading each scratch block

    def block(t):
        return (r - t - 2) % P

    def post_recvs(t):
        """Receives of step t: into scratch while reducing, straight into data while gathering."""
        blk = block(t)
        a0 = offs[blk]
        if t < reduce_phase:
            target, base = scratch[t % nscratch], 0
        else:
            target, base = data, a0
        return [(log.irecv(ring.comm, [target.bytes(base + a - a0, base + z - a0), MPI.BYTE], ring.left, tag), a, z)
                for a, z in chunk_ranges(a0, a0 + counts[blk], per)]

    sends = []
    first = steps[0]
    src_blk = (r - first - 1) % P
    for a, z in chunk_ranges(offs[src_blk], offs[src_blk] + counts[src_blk], per):
        sends.append(log.isend(ring.comm, [data.bytes(a, z), MPI.BYTE], ring.right, tag))
    pending = post_recvs(first)
    for t in steps:
        upcoming = None
        if t < last:
            k = (t + 1) % nscratch if scratch else 0
            if scratch and busy[k]:
                # That scratch block was forwarded a whole step ago: normally already complete.
                yield busy[k]
                busy[k] = []
            upcoming = post_recvs(t + 1)
        blk = block(t)
        a0 = offs[blk]
        for req, a, z in pending:
            yield [req]
            if t < reduce_phase:
                k = t % nscratch
                got = scratch[k].elements(a - a0, z - a0)
                if out is None:
                    acc = data
                    reduce_into(op, data.elements(a, z), data.elements(a, z), got)
                elif t == last:
                    acc = None
                    reduce_into(op, out.elements(a - a0, z - a0), data.elements(a, z), got)
                else:
                    acc = scratch[k]
                    reduce_into(op, got, data.elements(a, z), got)
                if t < last:
                    src = data.bytes(a, z) if acc is data else acc.bytes(a - a0, z - a0)
                    req_s = log.isend(ring.comm, [src, MPI.BYTE], ring.right, tag)
                    sends.append(req_s)
                    if acc is not data:
                        busy[k].append(req_s)
            elif t < last:
                sends.append(log.isend(ring.comm, [data.bytes(a, z), MPI.BYTE], ring.right, tag))
        pending = upcoming
    yield sends
    SCRATCH.give(*scratch)  # only here: a cancelled ring may still have a receive posted into them
