"""Rabenseifner's allreduce (recursive halving, then doubling), pipelined in chunks as the ring is."""

# 2·log2(P) steps, as few as recursive doubling's twice, moving 2(P-1)/P of the
# buffer as a ring does: the algorithm for messages too large for doubling and
# too small for a ring's 2(P-1) latencies. At halving step d a rank keeps the
# half of what it holds on its side of bit d, sends the other half to the
# partner across that bit and reduces the partner's half of its own half into
# it; after log2 P steps it holds block r of block_counts(n, P) reduced, and the
# doubling gathers the blocks back in the reverse order. P not a power of two:
# the same fold as doubling_allreduce.
#
#     P = 4, blocks 0-3      halving        d=2: 0<->2 1<->3 (keep 0-1 / 2-3)   d=1: 0<->1 2<->3 (keep one)
#                            doubling       d=1: 0<->1 2<->3 (hold two)         d=2: 0<->2 1<->3 (hold all)
#
# Sent whole, each step waits for its last byte and its sum before the next
# can start, and the link idles between steps: 1.2-1.3x the line-rate bound at
# 8-32 MiB on 4 hosts against the ring's 1.1x (benchmarks/claims.md, thirteenth
# and fourteenth passes). So every step moves chunks, in the order the receiver
# needs them next: a rank reduces each chunk as it lands and sends it on at
# once when its next step gives it away, while the rest of the step still
# arrives. Halving step d's receive order puts first the half that the receiver
# gives away at d/2, in the order its partner there wants it; a doubling step
# sends what the rank held before (ready) and then what it received at the
# previous step, in the order it arrived. Both ends derive the same chunks from
# the same ranges, so MPI's in-order matching pairs them.

from __future__ import annotations

import functools

from mpi4py import MPI

from .buffers import Buffer, block_counts, chunk_ranges, offsets, reduce_into
from .doubling import _folded, _world
from .requests import RequestLog
from .ring import DEFAULT_CHUNK_BYTES
from .scratch import SCRATCH

__all__ = ["halving_allreduce", "halving_steps"]


def halving_steps(size: int) -> int:
    """Sequential steps of Rabenseifner's allreduce over `size` ranks: log2 of the power of two, twice (+ fold)."""
    if size <= 1:
        return 0
    m = size.bit_length() - 1
    return 2 * m + (2 if size != 1 << m else 0)


def _halving_order(offs, lo, hi, d, receiver, per):
    """The chunks of blocks [lo, hi) as `receiver` takes them at halving step d: first the half it gives away
    at step d/2, in the order its partner there takes it, then the half it keeps."""
    if d == 1:
        return chunk_ranges(offs[lo], offs[hi], per)
    mid = (lo + hi) // 2
    give, keep = ((mid, hi), (lo, mid)) if not receiver & (d // 2) else ((lo, mid), (mid, hi))
    return (_halving_order(offs, *give, d // 2, receiver ^ (d // 2), per)
            + chunk_ranges(offs[keep[0]], offs[keep[1]], per))


def _doubling_blocks(new, d):
    """The blocks exchange rank `new` holds at doubling step d, in the order it sends them: its own block, then
    each step's arrivals in turn."""
    if d == 1:
        return [new]
    return _doubling_blocks(new, d // 2) + _doubling_blocks(new ^ (d // 2), d // 2)


def _plan(new, p2, rem, offs, per):
    """Each step as (partner, receive chunks, send chunks, reduces, keep range): halving steps, then doubling."""
    steps, lo, hi, d = [], 0, p2, p2 // 2
    while d:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if not new & d else ((mid, hi), (lo, mid))
        steps.append((_world(new ^ d, rem), _halving_order(offs, *keep, d, new, per),
                      _halving_order(offs, *give, d, new ^ d, per), True, (offs[keep[0]], offs[keep[1]])))
        lo, hi = keep
        d //= 2
    d = 1
    while d < p2:

        def chunks(blocks):
            return [c for b in blocks for c in chunk_ranges(offs[b], offs[b + 1], per)]

        steps.append((_world(new ^ d, rem), chunks(_doubling_blocks(new ^ d, d)), chunks(_doubling_blocks(new, d)),
                      False, None))
        d *= 2
    return steps


def _dependencies(steps):
    """For each send chunk, the (step, chunk) of the receive that last wrote its bytes, or None: ready at once.

    By construction a send chunk is exactly a chunk its last writer received; a send that overlaps an earlier
    receive without matching one would go out before its sum, so it is an error here, not a race later.
    """
    writer, deps = {}, []
    for i, (_, recvs, sends, _, _) in enumerate(steps):
        found = []
        for a, z in sends:
            w = writer.get((a, z))
            if w is None and any(x < z and a < y for x, y in writer):
                raise AssertionError(f"halving plan: send chunk {(a, z)} at step {i} matches no receive")
            found.append(w)
        deps.append(found)
        if recvs:  # this step's receives overwrite whatever wrote their range before
            lo, hi = min(a for a, _ in recvs), max(z for _, z in recvs)
            for key in [k for k in writer if k[0] < hi and lo < k[1]]:
                del writer[key]
            writer.update((c, (i, j)) for j, c in enumerate(recvs))
    return deps


@functools.lru_cache(maxsize=256)
def _schedule(new, p2, rem, count, per):
    """(steps, their send dependencies, the halving steps' keep ranges) of exchange rank `new` for `count`
    elements: the same every step of a training loop, so planned once (read-only; shared by every call)."""
    offs = offsets(block_counts(count, p2)) + [count]
    steps = _plan(new, p2, rem, offs, per)
    return steps, _dependencies(steps), [s[4] for s in steps if s[3]]


def halving_allreduce(comm: MPI.Comm, data: Buffer, op: str, tag: int, log: RequestLog,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """Generator (a Handle's algorithm): reduce `data` in place over `comm`; `comm`'s ranks all call it."""
    per = max(1, chunk_bytes // data.itemsize)

    def exchange(new, p2, rem, got):
        steps, deps, ranges = _schedule(new, p2, rem, data.count, per)
        # Halving steps receive into scratch, even ones into `got` (absolute offsets), odd ones into a second
        # buffer the size of the first odd step's range: one step's arrivals land while the last one's are summed.
        odd = SCRATCH.take(data, ranges[1][1] - ranges[1][0]) if len(ranges) > 1 else None
        scratch = [(got, 0) if i % 2 == 0 else (odd, ranges[1][0]) for i in range(len(ranges))]
        done = [0] * len(steps)  # receive chunks processed, per step
        posted = [0, 0]  # [step, chunk]: the next send; sends go out in step order, so each pair sees them in order
        out, by_step = [], [[] for _ in steps]

        def pump():
            s, k = posted
            while s < len(steps):
                partner, _, sends, _, _ = steps[s]
                while k < len(sends):
                    dep = deps[s][k]
                    if dep is not None and done[dep[0]] <= dep[1]:
                        posted[:] = s, k
                        return
                    a, z = sends[k]
                    req = log.isend(comm, [data.bytes(a, z), MPI.BYTE], partner, tag)
                    out.append(req)
                    by_step[s].append(req)
                    k += 1
                s, k = s + 1, 0
            posted[:] = s, k

        def post_recvs(i):
            partner, recvs, _, reduces, _ = steps[i]
            buf, base = scratch[i] if reduces else (data, 0)
            return [log.irecv(comm, [buf.bytes(a - base, z - base), MPI.BYTE], partner, tag) for a, z in recvs]

        def receivable(i):
            """A doubling step's receive lands where the halving step with the same partner sent from."""
            if steps[i][3]:
                return []
            mirror = 2 * len(ranges) - 1 - i
            return by_step[mirror] if mirror < len(steps) and steps[mirror][3] else []

        pump()
        pending = post_recvs(0)
        for i, (_, recvs, _, reduces, _) in enumerate(steps):
            upcoming = None
            if i + 1 < len(steps):
                wait = receivable(i + 1)
                if wait:
                    yield wait
                upcoming = post_recvs(i + 1)
            buf, base = scratch[i] if reduces else (data, 0)
            for j, (req, (a, z)) in enumerate(zip(pending, recvs)):
                yield [req]
                if reduces:
                    reduce_into(op, data.elements(a, z), data.elements(a, z), buf.elements(a - base, z - base))
                done[i] = j + 1
                pump()
            pending = upcoming
        yield out
        SCRATCH.give(odd)  # only here: a cancelled exchange may still have a receive posted into it

    yield from _folded(comm, data, op, tag, log, exchange)
