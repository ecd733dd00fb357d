"""Hierarchical allreduce: reduce-scatter inside the node, allreduce of each 1/L block across nodes, allgather inside.

    node 0: ranks 0 1      node 1: ranks 2 3        (N = 2 nodes, L = 2 ranks each)
    1. node reduce-scatter    rank 0 holds block 0 of its node's sum, rank 1 block 1 (same on node 1)
    2. cross allreduce        ranks 0 <-> 2 reduce block 0, ranks 1 <-> 3 block 1: L rings at once,
                              each over 1/L of the data, so a node's link carries 2(N-1)/N of it once
    3. node allgather         every rank of a node gathers the L reduced blocks

A flat ring over P = N·L ranks sends 2(P-1)/P of the data over each node's
link and takes 2(P-1) steps; here the link sees 2(N-1)/N in 2(N-1) cross
steps (or log2 N with recursive doubling across, for small blocks), and the
2(L-1) node steps run over shared memory.
"""

from __future__ import annotations

from .buffers import Buffer, block_counts, offsets
from .doubling import doubling_allreduce
from .requests import RequestLog
from .ring import Ring

__all__ = ["hierarchical_allreduce"]


def hierarchical_allreduce(node: Ring, cross: Ring, data: Buffer, op: str, tag: int, log: RequestLog,
                           across: str = "ring"):
    """Generator (a Handle's algorithm): reduce `data` in place over node x cross; `across`: ring or doubling.

    `node` and `cross` are unvalidated Rings over the node and cross
    communicators of one Topology; the result equals the flat allreduce's
    within float rounding (another order of additions).
    """
    L, lr = node.size, node.rank
    counts = block_counts(data.count, L)
    lo = offsets(counts)[lr]
    yield from node._ring(data, counts, range(0, L - 1), op, tag, log)  # block lr of the node's sum
    block = Buffer(data.elements(lo, lo + counts[lr]), checked=True)
    if across == "doubling":
        yield from doubling_allreduce(cross.comm, block, op, tag, log)
    else:
        yield from cross._ring(block, block_counts(block.count, cross.size), range(0, 2 * cross.size - 2), op,
                               tag, log)
    yield from node._ring(data, counts, range(L - 1, 2 * L - 2), None, tag, log)
