"""Hierarchical allreduce: reduce-scatter in the node, allreduce of each 1/L block across nodes, allgather inside."""

#     node 0: ranks 0 1      node 1: ranks 2 3        (N = 2 nodes, L = 2 ranks each)
#     1. node reduce-scatter    rank 0 holds block 0 of its node's sum, rank 1 block 1 (same on node 1)
#     2. cross allreduce        ranks 0 <-> 2 reduce block 0, ranks 1 <-> 3 block 1: L rings at once,
#                               each over 1/L of the data, so a node's link carries 2(N-1)/N of it once
#     3. node allgather         every rank of a node gathers the L reduced blocks
#
# A flat ring over P = N·L ranks sends 2(P-1)/P of the data over each node's
# link and takes 2(P-1) steps; here the link sees 2(N-1)/N in 2(N-1) cross
# steps (or 2·log2 N with Rabenseifner's, log2 N with recursive doubling, for
# smaller blocks), and the
# 2(L-1) node steps run over shared memory.

from __future__ import annotations

from mpi4py import MPI

from .buffers import Buffer, block_counts, offsets
from .doubling import doubling_allreduce
from .halving import halving_allreduce
from .handle import Step
from .requests import RequestLog
from .ring import Ring
from .ring_steps import ring_steps
from .scratch import SCRATCH

__all__ = ["LANES", "PIECE_BYTES", "contiguous", "hierarchical_allgather", "hierarchical_allreduce",
           "hierarchical_reduce_scatter", "node_steps", "pieces", "pipelined"]

# A large message goes as up to LANES pieces of at least PIECE_BYTES, each on its own node and cross
# communicators, staggered: a piece starts once the one before has reduced inside the node, so one piece's
# node steps (shared memory) overlap another's cross-node steps (the link), instead of the link idling
# while the node reduces.
LANES, PIECE_BYTES = 4, 4 << 20
REDUCED = []  # what a piece yields (passed at once) when its node reduce-scatter is over: the next may start


def pieces(nbytes: int) -> int:
    """How many pieces a hierarchical allreduce of `nbytes` goes in."""
    return int(max(1, min(LANES, nbytes // PIECE_BYTES)))


def hierarchical_allreduce(node: Ring, cross: Ring, data: Buffer, op: str, tag: int, log: RequestLog,
                           across: str = "ring", stage=None):
    """Generator (a Handle's algorithm): reduce `data` in place over node x cross; `across`: ring, doubling
    or rabenseifner (the cross-node step's algorithm).

    `node` and `cross` are unvalidated Rings over the node and cross
    communicators of one Topology; the result equals the flat allreduce's
    within float rounding (another order of additions). With a NodeStage
    (mpicomm.node_stage), the node steps go through its shared window instead
    of the node ring's messages.
    """
    L, lr = node.size, node.rank
    counts = block_counts(data.count, L)
    lo = offsets(counts)[lr]
    call = stage.open() if stage is not None else None
    if call is not None:
        yield from stage.reduce_scatter(call, data, counts, op, tag, log)
    else:
        yield from ring_steps(node, data, counts, range(0, L - 1), op, tag, log)  # block lr of the node's sum
    yield REDUCED
    block = Buffer(data.elements(lo, lo + counts[lr]), checked=True)
    if across == "doubling":
        yield from doubling_allreduce(cross.comm, block, op, tag, log)
    elif across == "rabenseifner":
        yield from halving_allreduce(cross.comm, block, op, tag, log, cross.chunk_bytes)
    else:
        yield from ring_steps(cross, block, block_counts(block.count, cross.size), range(0, 2 * cross.size - 2), op,
                              tag, log)
    if call is not None:
        yield from stage.allgather(call, data, counts, tag, log)
        yield from stage.close(call, tag, log)
    else:
        yield from ring_steps(node, data, counts, range(L - 1, 2 * L - 2), None, tag, log)


def pipelined(lanes: list[tuple[Ring, Ring]], data: Buffer, op: str, tag: int, log: RequestLog, across: str,
              stages=None):
    """Generator: `data` in len(lanes) contiguous pieces, each a hierarchical allreduce on its own lane's
    (node, cross) Rings (and NodeStage, with `stages`), all in flight at once; returns when every piece is
    reduced."""
    k = len(lanes)
    counts = block_counts(data.count, k)
    starts = offsets(counts)
    gens = [hierarchical_allreduce(node, cross, Buffer(data.elements(a, a + n), checked=True), op, tag, log, across,
                                   stage)
            for (node, cross), a, n, stage in zip(lanes, starts, counts, stages or [None] * k)]
    yield Together(gens)


class Together(Step):
    """Pieces (generators yielding request lists) driven as one wait point, passed when all have ended; each
    piece after the first starts when the one before yields REDUCED."""

    __slots__ = ("gens", "waits", "started")
    _DONE = object()

    def __init__(self, gens):
        self.gens, self.waits, self.started = list(gens), [], 0
        self._start()

    def _start(self) -> None:
        """Start the next piece (and so on while each one reaches REDUCED at once: a node of one rank)."""
        while self.started < len(self.gens) and (not self.waits or self.waits[-1] is REDUCED
                                                 or self.waits[-1] is self._DONE):
            self.waits.append(self._next(self.gens[self.started]))
            self.started += 1

    def _next(self, gen):
        try:
            return gen.send(None)
        except StopIteration:
            return self._DONE
        except BaseException:  # the handle ends with this error (Handle._ready); the other pieces are dropped
            for g in self.gens:
                g.close()
            raise

    def poll(self, block: bool) -> bool:
        while True:
            moved = False
            for i, w in enumerate(self.waits):
                if w is REDUCED and i == len(self.waits) - 1 and self.started < len(self.gens):
                    continue  # the next piece starts from it first (below)
                if w is not self._DONE and MPI.Request.Testall(w):
                    self.waits[i], moved = self._next(self.gens[i]), True
            if self.started < len(self.gens) and (self.waits[-1] is REDUCED or self.waits[-1] is self._DONE):
                self._start()
                moved = True
            pending = [i for i, w in enumerate(self.waits) if w is not self._DONE]
            if not pending and self.started == len(self.gens):
                return True
            if moved:
                continue
            if not block:
                return False
            # Block on one piece's step; the others progress inside MPI meanwhile and are tested next pass.
            MPI.Request.Waitall(self.waits[pending[0]])


def contiguous(nodes: list[list[int]]) -> bool:
    """Whether node m holds world ranks m·L .. m·L+L-1 (as launchers place ranks node by node): the layout the
    hierarchical reduce-scatter and allgather keep the flat ring's blocks in."""
    L = len(nodes[0])
    return all(ranks == list(range(m * L, (m + 1) * L)) for m, ranks in enumerate(nodes))


def node_steps(node: Ring, stage, data: Buffer, counts: list[int], op, tag: int, log: RequestLog):
    """Generator: each node's chunk of `data` (L blocks of `counts` per node, node by node) reduce-scattered
    inside the node (op) or, with op None, allgathered; through the NodeStage's window where there is one."""
    L = node.size
    offs = offsets(counts) + [data.count]
    call = stage.open() if stage is not None else None
    for m in range(len(counts) // L):
        chunk = Buffer(data.elements(offs[m * L], offs[(m + 1) * L]), checked=True)
        part = counts[m * L:(m + 1) * L]
        if call is None:
            yield from ring_steps(node, chunk, part, range(0, L - 1) if op else range(L - 1, 2 * L - 2), op, tag, log)
        elif op:
            yield from stage.reduce_scatter(call, chunk, part, op, tag, log)
        else:
            yield from stage.allgather(call, chunk, part, tag, log)
    if call is not None:
        yield from stage.close(call, tag, log)


def hierarchical_reduce_scatter(node: Ring, cross: Ring, data: Buffer, counts: list[int], op: str, tag: int,
                                log: RequestLog, stage=None):
    """Generator: block r of `counts` (world order) ends reduced in place on world rank r, as Ring's in-place
    reduce-scatter leaves it; ranks placed node by node (contiguous()).

    Node m's blocks are reduced inside every node first (a node reduce-scatter per node's chunk, so local
    rank l holds its node's sum of block m·L+l for every m), then the cross ring of local rank l reduces
    those N blocks (gathered into one scratch buffer) across nodes: the link carries (N-1)/N of the data.
    """
    L, N, l, n = node.size, cross.size, node.rank, cross.rank
    offs = offsets(counts) + [data.count]
    yield from node_steps(node, stage, data, counts, op, tag, log)
    mine = [counts[m * L + l] for m in range(N)]
    gathered = SCRATCH.take(data, sum(mine))
    at = offsets(mine)
    for m in range(N):
        gathered.bytes(at[m], at[m] + mine[m])[...] = data.bytes(offs[m * L + l], offs[m * L + l + 1])
    yield from ring_steps(cross, gathered, mine, range(0, N - 1), op, tag, log)
    r = n * L + l
    data.bytes(offs[r], offs[r + 1])[...] = gathered.bytes(at[n], at[n] + mine[n])
    SCRATCH.give(gathered)


def hierarchical_allgather(node: Ring, cross: Ring, data: Buffer, counts: list[int], tag: int, log: RequestLog,
                           stage=None):
    """Generator: every rank's block r (already in place in `data`) gathered everywhere: across nodes within
    each cross group first (its blocks gathered into scratch), then inside each node, chunk by chunk."""
    L, N, l, n = node.size, cross.size, node.rank, cross.rank
    offs = offsets(counts) + [data.count]
    mine = [counts[m * L + l] for m in range(N)]
    gathered = SCRATCH.take(data, sum(mine))
    at = offsets(mine)
    r = n * L + l
    gathered.bytes(at[n], at[n] + mine[n])[...] = data.bytes(offs[r], offs[r + 1])
    yield from ring_steps(cross, gathered, mine, range(N - 1, 2 * N - 2), None, tag, log)
    for m in range(N):
        data.bytes(offs[m * L + l], offs[m * L + l + 1])[...] = gathered.bytes(at[m], at[m] + mine[m])
    SCRATCH.give(gathered)
    yield from node_steps(node, stage, data, counts, None, tag, log)
