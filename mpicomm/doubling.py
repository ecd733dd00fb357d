"""Recursive doubling allreduce on Isend/Irecv: log2 P steps, for large P; the fold of a P not a power of two."""

# A ring allreduce takes 2(P-1) steps, each a message of S/P: at 1,024 ranks a
# 1 MiB bucket is 2,046 sequential latencies. Recursive doubling exchanges the
# whole buffer with rank r XOR 2^k at step k: log2(P) latencies and log2(P)·S
# bytes, so it wins while the message is small against P (jobs.bench.collectives
# measures the crossover). P not a power of two: the first 2·(P - 2^m) ranks
# fold in pairs first (the even rank hands its data to the odd one and sits the
# exchange out) and receive the result at the end, two more steps.
#
#     P = 6 (2^m = 4, 2 folded pairs; exchange ranks 1:0 3:1 4:2 5:3)
#       fold     0 -> 1   2 -> 3
#       step 1   1 <-> 3   4 <-> 5       (exchange ranks 0 <-> 1, 2 <-> 3)
#       step 2   1 <-> 4   3 <-> 5       (exchange ranks 0 <-> 2, 1 <-> 3)
#       unfold   1 -> 0   3 -> 2
#
# Every pair reduces lower rank's operand first, so both partners compute the
# same bits and every rank ends with the identical result.

from __future__ import annotations

from mpi4py import MPI

from .buffers import Buffer, reduce_into
from .requests import RequestLog
from .scratch import SCRATCH

__all__ = ["doubling_allreduce", "doubling_steps"]


def doubling_steps(size: int) -> int:
    """Sequential message steps of a recursive-doubling allreduce over `size` ranks (the fold counts two)."""
    if size <= 1:
        return 0
    m = size.bit_length() - 1
    return m + (2 if size != 1 << m else 0)


def _world(new: int, rem: int) -> int:
    """The rank of exchange participant `new`: the odd rank of a folded pair, else shifted past the pairs."""
    return 2 * new + 1 if new < rem else new + rem


def _folded(comm: MPI.Comm, data: Buffer, op: str, tag: int, log: RequestLog, exchange):
    """Generator: `exchange(new, p2, rem, got)` among 2^m exchange ranks, the rest folded in around it.

    The first 2(P - 2^m) ranks pair up: the even one hands its data to the odd one (which reduces it,
    the lower rank's operand first), sits the exchange out and receives the result from it at the end.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1 or data.count == 0:
        return
    p2 = 1 << (size.bit_length() - 1)
    rem = size - p2
    whole = [data.bytes(), MPI.BYTE]
    if rank < 2 * rem and rank % 2 == 0:
        yield [log.isend(comm, whole, rank + 1, tag)]
        yield [log.irecv(comm, whole, rank + 1, tag)]
        return
    got = SCRATCH.take(data, data.count)
    if rank < 2 * rem:
        yield [log.irecv(comm, [got.bytes(), MPI.BYTE], rank - 1, tag)]
        reduce_into(op, data.flat, got.flat, data.flat)
    yield from exchange(rank // 2 if rank < 2 * rem else rank - rem, p2, rem, got)
    if rank < 2 * rem:
        yield [log.isend(comm, whole, rank - 1, tag)]
    SCRATCH.give(got)  # only here: a cancelled exchange may still have a receive posted into it


def doubling_allreduce(comm: MPI.Comm, data: Buffer, op: str, tag: int, log: RequestLog):
    """Generator (a Handle's algorithm): reduce `data` in place over `comm`; `comm`'s ranks all call it."""
    rank = comm.Get_rank()

    def exchange(new, p2, rem, got):
        whole, into = [data.bytes(), MPI.BYTE], [got.bytes(), MPI.BYTE]
        mask = 1
        while mask < p2:
            partner = _world(new ^ mask, rem)
            yield [log.isend(comm, whole, partner, tag), log.irecv(comm, into, partner, tag)]
            if partner < rank:
                reduce_into(op, data.flat, got.flat, data.flat)
            else:
                reduce_into(op, data.flat, data.flat, got.flat)
            mask <<= 1

    yield from _folded(comm, data, op, tag, log, exchange)
