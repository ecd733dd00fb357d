"""Recursive doubling and Rabenseifner's halving-doubling allreduce on Isend/Irecv: log2 P steps, for large P.

A ring allreduce takes 2(P-1) steps, each a message of S/P: at 1,024 ranks a
1 MiB bucket is 2,046 sequential latencies. Recursive doubling exchanges the
whole buffer with rank r XOR 2^k at step k: log2(P) latencies and log2(P)·S
bytes, so it wins while the message is small against P (jobs.bench.collectives
measures the crossover). P not a power of two: the first 2·(P - 2^m) ranks
fold in pairs first (the even rank hands its data to the odd one and sits the
exchange out) and receive the result at the end, two more steps.

    P = 6 (2^m = 4, 2 folded pairs; exchange ranks 1:0 3:1 4:2 5:3)
      fold     0 -> 1   2 -> 3
      step 1   1 <-> 3   4 <-> 5       (exchange ranks 0 <-> 1, 2 <-> 3)
      step 2   1 <-> 4   3 <-> 5       (exchange ranks 0 <-> 2, 1 <-> 3)
      unfold   1 -> 0   3 -> 2

Every pair reduces lower rank's operand first, so both partners compute the
same bits and every rank ends with the identical result.
"""

from __future__ import annotations

from mpi4py import MPI

from .buffers import Buffer, block_counts, offsets, reduce_into
from .requests import RequestLog

__all__ = ["doubling_allreduce", "doubling_steps", "halving_allreduce", "halving_steps"]


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
    whole, got = [data.bytes(), MPI.BYTE], data.scratch(data.count)
    if rank < 2 * rem and rank % 2 == 0:
        yield [log.isend(comm, whole, rank + 1, tag)]
        yield [log.irecv(comm, whole, rank + 1, tag)]
        return
    if rank < 2 * rem:
        yield [log.irecv(comm, [got.bytes(), MPI.BYTE], rank - 1, tag)]
        reduce_into(op, data.flat, got.flat, data.flat)
    yield from exchange(rank // 2 if rank < 2 * rem else rank - rem, p2, rem, got)
    if rank < 2 * rem:
        yield [log.isend(comm, whole, rank - 1, tag)]


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


def halving_steps(size: int) -> int:
    """Sequential steps of Rabenseifner's allreduce over `size` ranks: log2 of the power of two, twice (+ fold)."""
    if size <= 1:
        return 0
    m = size.bit_length() - 1
    return 2 * m + (2 if size != 1 << m else 0)


def halving_allreduce(comm: MPI.Comm, data: Buffer, op: str, tag: int, log: RequestLog):
    """Generator: Rabenseifner's allreduce, a reduce-scatter by recursive halving then an allgather by doubling.

    2·log2(P) steps, as few as recursive doubling's twice, moving 2(P-1)/P of the buffer as a ring does:
    the algorithm for messages too large for doubling and too small for a ring's 2(P-1) latencies. At step k
    of the halving a rank keeps half of what it holds (the lower half where bit k from the top of its rank is
    0), sends the other half to the partner across that bit and reduces the partner's half of its own half
    into it; after log2 P steps it holds block r of block_counts(n, P) reduced, and the doubling gathers the
    blocks back in the reverse order. P not a power of two: the same fold as doubling_allreduce.

        P = 4, blocks 0-3      halving        d=2: 0<->2 1<->3 (keep 0-1 / 2-3)   d=1: 0<->1 2<->3 (keep one)
                               doubling       d=1: 0<->1 2<->3 (hold two)         d=2: 0<->2 1<->3 (hold all)
    """

    def exchange(new, p2, rem, got):
        offs = offsets(block_counts(data.count, p2)) + [data.count]
        lo, hi = 0, p2  # the blocks this rank holds
        d = p2 // 2
        while d:  # halving: keep the half on this rank's side of bit d
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if not new & d else ((mid, hi), (lo, mid))
            a, z = offs[keep[0]], offs[keep[1]]
            partner = _world(new ^ d, rem)
            yield [log.isend(comm, [data.bytes(offs[give[0]], offs[give[1]]), MPI.BYTE], partner, tag),
                   log.irecv(comm, [got.bytes(a, z), MPI.BYTE], partner, tag)]
            reduce_into(op, data.elements(a, z), data.elements(a, z), got.elements(a, z))
            lo, hi = keep
            d //= 2
        d = 1
        while d < p2:  # doubling: swap what each holds with the partner across bit d
            width = hi - lo
            other = (lo - width, lo) if new & d else (hi, hi + width)
            partner = _world(new ^ d, rem)
            yield [log.isend(comm, [data.bytes(offs[lo], offs[hi]), MPI.BYTE], partner, tag),
                   log.irecv(comm, [data.bytes(offs[other[0]], offs[other[1]]), MPI.BYTE], partner, tag)]
            lo, hi = min(lo, other[0]), max(hi, other[1])
            d *= 2

    yield from _folded(comm, data, op, tag, log, exchange)
