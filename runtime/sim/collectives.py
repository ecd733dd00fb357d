"""What each exchange of the toolkit moves over one host's links, as simulated transfers, and a FIFO stream."""

# Byte counts follow the algorithms in mpicomm, for P ranks on N nodes of L
# ranks each, world ranks placed node by node (a ring then crosses each host's
# link once per step, and its other L - 1 hops stay in shared memory):
#   ring allreduce         2(P-1) steps of B/P per rank
#   doubling allreduce     log2 P steps (two more when P is no power of two) of B per rank; a step
#                          whose partner is 2^k >= L ranks away crosses the link for all L ranks
#   rabenseifner allreduce 2·log2 P steps (halving, then doubling), 2(P-1)/P·B per rank
#   hierarchical allreduce 2(L-1) node steps of B/L (shared memory), then L cross-node allreduces of
#                          B/L at once (ring, doubling or rabenseifner): the link carries 2(N-1)/N·B
#                          (ring, rabenseifner)
# The allreduce's algorithm is the runtime's own choice (mpicomm.algorithms.Chooser, "auto" unless
# the schedule names one), told this cluster's latency and rates.
#   ring reduce-scatter,   P-1 steps of B/P per rank (allgather: of the rank's part)
#   p3 slice of s bytes    a push to its owner and the owner's pull back: 2 messages;
#                          of a host's L ranks' slices, (P-L)/P of the bytes cross the link; with
#                          node-local aggregation 4 messages, 2(N-1)/N·s on the link, 2(L-1)·s in the node
#   flat top-k             an allgather of each rank's k (index, value) pairs (8 bytes each for fp32)
#   hierarchical top-k     node reduce-scatter (shared memory), an allgather of k/L pairs per
#                          rank across nodes (L of them in parallel), a node allgather
#   small collectives      the step's agreement (recursive doubling of a few bytes) and the module
#                          buffers' allreduce (Rabenseifner's): each step that crosses the link
#                          waits for the transfers already on it, first in, first out
# Each step or message also pays the cluster's latency. Where mpicomm hands a
# collective to MPI's own (mpicomm.native: PTO's and the sparse exchanges'
# rings, below the crossover) the latency is paid ceil(log2 P) times per phase
# (recursive doubling, Rabenseifner) and the bytes are the ring's.

from __future__ import annotations

import functools
import math
from collections import deque

from mpicomm.algorithms import Chooser, CostModel, Layout
from mpicomm.doubling import doubling_steps
from mpicomm.halving import halving_steps
from mpicomm.hierarchical import pieces
from mpicomm.native import DEFAULT_LATENCY_BYTES

from .cluster import Host
from .engine import Event, all_of

PAIR_BYTES = 8  # a fp32 value and its int32 index (mpicomm.sparse_pairs.pack)


def _ring(host: Host, name: str, steps: int, chunk: float, native: str | None = None, nbytes: float = 0.0):
    """`steps` ring steps of `chunk` bytes per rank: the link carries one chunk per step, shared memory L-1.

    native: the mpicomm.native kind when the caller's ring would take MPI's path for its `nbytes` below
    the crossover (one phase: reduce-scatter or allgather).
    """
    c = host.cluster
    P, L, N = c.ranks, c.ranks_per_node, c.nodes
    if P == 1 or chunk <= 0:
        return
    rounds = steps
    if native is not None and nbytes < DEFAULT_LATENCY_BYTES[native]:
        rounds = math.ceil(math.log2(P))
    yield host.engine.timeout(rounds * c.latency)
    per_rank = steps * chunk
    nic = per_rank if N > 1 else 0.0
    shm = (L - 1) * per_rank
    yield host.engine.start(host.transfer(name, nic, shm, cpu_bytes=L * per_rank))


def choose(cluster, nbytes: float, algorithm: str | None = None) -> str:
    """The algorithm the runtime's Chooser takes for an allreduce of `nbytes` on this cluster."""
    return _chooser(cluster, algorithm or "auto").choose(int(nbytes))


def fuse_size(cluster, algorithm: str | None, total: float) -> int:
    """wfbp's fuse_bytes="auto" on this cluster for `total` bytes of gradients (runtime.dense.wfbp.auto_fuse_bytes:
    CostModel.fuse_size with the chooser its buckets' allreduce takes)."""
    chooser = _chooser(cluster, algorithm or "auto")
    return chooser.model.fuse_size(chooser.layout, chooser.choose, total)


@functools.lru_cache(maxsize=256)
def _chooser(cluster, algorithm: str) -> Chooser:
    model = CostModel(alpha=cluster.latency, beta_cross=8 / (cluster.bandwidth * cluster.efficiency),
                      beta_node=8 / cluster.intra_bandwidth)
    return Chooser(Layout(cluster.ranks, cluster.nodes, cluster.ranks_per_node), algorithm, table={}, model=model)


def allreduce(host: Host, nbytes: float, name: str = "allreduce", algorithm: str | None = None):
    """An allreduce of `nbytes` per rank by `algorithm` (None: the runtime's auto choice)."""
    c = host.cluster
    how = choose(c, nbytes, algorithm)
    if how == "doubling":
        yield from _doubling(host, name, nbytes, c.ranks, c.ranks_per_node)
    elif how == "rabenseifner":
        yield from _rabenseifner(host, name, nbytes, c.ranks, c.ranks_per_node)
    elif how == "hierarchical":
        yield from _hierarchical(host, name, nbytes)
    else:
        yield from _ring(host, name, 2 * (c.ranks - 1), nbytes / c.ranks)


def behind_the_link(host: Host) -> Event:
    """Fires once the transfers now on this host's outgoing link are done. A message of a few bytes sent now waits
    behind their bytes, not beside them: TCP carries a peer's messages in order on one connection and the host's
    interface queue (tc tbf's) is first in, first out. The link's fluid fair share is for bulk transfers."""
    return all_of(host.engine.active_on(host.out))


def small_allreduce(host: Host):
    """MPI's allreduce of a few bytes (mpicomm.step_check's round each step): recursive doubling, each step that
    crosses the link queued behind what is on it, then the latency."""
    c = host.cluster
    m = c.ranks.bit_length() - 1
    steps = doubling_steps(c.ranks)
    folds = steps - m  # the fold and unfold cross the link where nodes hold one rank each
    across = _doubling_across(c.ranks, c.ranks_per_node) + (folds if c.ranks_per_node == 1 else 0)
    for k in range(steps):
        if k < across and c.nodes > 1:
            yield behind_the_link(host)
        yield host.engine.timeout(c.latency)


def queued_allreduce(host: Host, nbytes: float, name: str):
    """MPI's own allreduce of a buffer small beside the bulk traffic it is sent into (runtime.model_buffers'):
    Rabenseifner's steps (MPICH's choice over 2 KiB) in turn, each one that crosses the link queued behind what is
    on it, then sent."""
    c = host.cluster
    for part, across in _rabenseifner_steps(nbytes, c.ranks, c.ranks_per_node):
        across = across and c.nodes > 1
        if across:
            yield behind_the_link(host)
        yield host.engine.timeout(c.latency)
        moved = c.ranks_per_node * part
        yield host.engine.start(host.transfer(name, moved if across else 0.0, 0.0 if across else moved))


def _doubling_across(ranks: int, per_node: int) -> int:
    """Recursive doubling's exchange steps (folds aside) whose partner is on another node, ranks node by node."""
    return sum(1 for k in range(ranks.bit_length() - 1) if (1 << k) >= per_node)


def _rabenseifner_steps(nbytes: float, ranks: int, per_node: int) -> list[tuple[float, bool]]:
    """Rabenseifner's steps in order, each (bytes a rank sends, whether its partner is on another node): the fold,
    the halving steps (n/2, n/4, ...), their mirror in the doubling, the unfold. A fold pairs neighbours, on
    another node only where nodes hold one rank each."""
    m = ranks.bit_length() - 1
    p2 = 1 << m
    fold = [(nbytes * (ranks - p2) / ranks, per_node == 1)] * ((halving_steps(ranks) - 2 * m) // 2)
    halving = [(nbytes / (2 << k), (p2 >> (k + 1)) >= per_node) for k in range(m)]
    return fold + halving + halving[::-1] + fold


def _doubling(host: Host, name: str, nbytes: float, ranks: int, per_node: int, lanes: int = 1):
    """Recursive doubling over `ranks` (node by node, `per_node` each): every step moves the whole buffer.

    lanes: how many such exchanges of the host's ranks run at once (the hierarchy's cross step: L of them,
    one rank each per node), their bytes on the same link.
    """
    c = host.cluster
    steps = doubling_steps(ranks)
    if steps == 0 or nbytes <= 0:
        return
    m = ranks.bit_length() - 1
    across = _doubling_across(ranks, per_node)
    # The fold and unfold: one whole buffer from each of the 2(P - 2^m) paired ranks, within its pair (a node's
    # when nodes hold pairs): per rank, on average, this many buffers.
    folds = (steps - m) * (ranks - (1 << m)) / ranks
    yield host.engine.timeout(steps * c.latency)
    ranks_here = per_node * lanes
    nic = ranks_here * nbytes * (across + (folds if per_node == 1 else 0.0)) if c.nodes > 1 else 0.0
    shm = ranks_here * nbytes * (m - across + (folds if per_node > 1 else 0.0))
    yield host.engine.start(host.transfer(name, nic, shm, cpu_bytes=nic + shm))


def _rabenseifner(host: Host, name: str, nbytes: float, ranks: int, per_node: int, lanes: int = 1):
    """Halving then doubling over `ranks`: 2·log2 steps, 2(p-1)/p of the buffer per rank; lanes as _doubling's."""
    c = host.cluster
    steps = halving_steps(ranks)
    if steps == 0 or nbytes <= 0:
        return
    ranks_here = per_node * lanes
    parts = _rabenseifner_steps(nbytes, ranks, per_node)
    nic = ranks_here * sum(part for part, across in parts if across)
    shm = ranks_here * sum(part for part, across in parts if not across)
    yield host.engine.timeout(steps * c.latency)
    nic = nic if c.nodes > 1 else 0.0
    yield host.engine.start(host.transfer(name, nic, shm, cpu_bytes=nic + shm))


def _hierarchical(host: Host, name: str, nbytes: float):
    """mpicomm.hierarchical's: a large message in pieces(), each its own node-cross-node chain, each starting
    once the one before has reduced inside the node."""
    k = pieces(int(nbytes))
    if k == 1:
        yield from _hierarchical_piece(host, name, nbytes)
        return
    done, after = [], None
    for i in range(k):
        reduced = Event()
        done.append(host.engine.process(_hierarchical_piece(host, f"{name} piece {i}", nbytes / k, after, reduced)))
        after = reduced
    yield all_of(done)


def _hierarchical_piece(host: Host, name: str, nbytes: float, after: Event | None = None,
                        reduced: Event | None = None):
    if after is not None:
        yield after
    c = host.cluster
    L, N = c.ranks_per_node, c.nodes
    block = nbytes / L
    if L > 1:  # node reduce-scatter: shared memory
        yield host.engine.timeout((L - 1) * c.latency)
        yield host.engine.start(host.transfer(f"{name} node reduce-scatter", 0.0, (L - 1) * nbytes,
                                              cpu_bytes=(L - 1) * nbytes))
    if reduced is not None:
        reduced.succeed()
    across = _chooser(c, "auto").model.cross_algorithm(nbytes, _chooser(c, "auto").layout)
    if across == "doubling":
        yield from _doubling(host, f"{name} cross", block, N, 1, lanes=L)
    elif across == "rabenseifner":
        yield from _rabenseifner(host, f"{name} cross", block, N, 1, lanes=L)
    elif N > 1:  # L cross rings at once, a block of B/L each: the link carries 2(N-1)/N·B
        yield host.engine.timeout(2 * (N - 1) * c.latency)
        nic = L * 2 * (N - 1) * block / N
        yield host.engine.start(host.transfer(f"{name} cross ring", nic, 0.0, cpu_bytes=nic))
    if L > 1:  # node allgather
        yield host.engine.timeout((L - 1) * c.latency)
        yield host.engine.start(host.transfer(f"{name} node allgather", 0.0, (L - 1) * nbytes,
                                              cpu_bytes=(L - 1) * nbytes))


def reduce_scatter(host: Host, nbytes: float, name: str = "reduce-scatter", native: bool = False,
                   hierarchical: bool = False):
    """The flat ring's; hierarchical (mpicomm.Collectives', PTO's gradients): on two levels the hierarchy."""
    c = host.cluster
    if hierarchical and c.nodes > 1 and c.ranks_per_node > 1:
        yield from _two_level_blocks(host, name, nbytes)
        return
    yield from _ring(host, name, c.ranks - 1, nbytes / c.ranks, "reduce_scatter" if native else None, nbytes)


def allgather(host: Host, part_bytes: float, name: str = "allgather", native: bool = False,
              hierarchical: bool = False):
    """Every rank ends with all P parts of `part_bytes` each: the flat ring's, or (hierarchical) as reduce_scatter."""
    c = host.cluster
    if hierarchical and c.nodes > 1 and c.ranks_per_node > 1:
        yield from _two_level_blocks(host, name, c.ranks * part_bytes)
        return
    yield from _ring(host, name, c.ranks - 1, part_bytes, "allgather" if native else None, c.ranks * part_bytes)


def _two_level_blocks(host: Host, name: str, nbytes: float):
    """mpicomm.hierarchical's reduce-scatter (or, mirrored, allgather) of `nbytes`: a node ring per node's chunk
    (N·(L-1) steps, (L-1)/L of the data per rank in shared memory), one cross ring of N-1 steps ((N-1)/N of
    it over the host's link)."""
    c = host.cluster
    L, N = c.ranks_per_node, c.nodes
    yield host.engine.timeout(N * (L - 1) * c.latency)
    shm = (L - 1) * nbytes
    yield host.engine.start(host.transfer(f"{name} in the node", 0.0, shm, cpu_bytes=shm))
    yield host.engine.timeout((N - 1) * c.latency)
    nic = (N - 1) / N * nbytes
    yield host.engine.start(host.transfer(f"{name} across", nic, 0.0, cpu_bytes=nic))


def slice_round_trip(host: Host, nbytes: float, name: str = "slice", poll: float = 0.0, aggregate: bool = True):
    """One p3 slice of every rank of the host: pushed to its owner, averaged, pulled back.

    aggregate (node-local aggregation, on N > 1 nodes of L > 1 ranks): the node's ranks push it to its
    aggregator, which exchanges it with the owner's node: 4 messages in turn, and the link carries the
    slice once each way from the nodes that do not own it (2(N-1)/N of it per host each way).
    poll: the progress thread's sleep between polls; each message is seen done half of one late on
    average (the owner's before it pulls, ours before the credit is reused).
    """
    c = host.cluster
    P, L, N = c.ranks, c.ranks_per_node, c.nodes
    if P == 1:
        return
    if aggregate and N > 1 and L > 1:
        # 4 messages in turn; 2 for the 1/N of slices whose owner is on this node (no cross step for them).
        yield host.engine.timeout((4 - 2 / N) * (c.latency + poll / 2))
        nic = 2 * nbytes * (N - 1) / N
        shm = 2 * nbytes * (L - 1)
    else:
        yield host.engine.timeout(2 * (c.latency + poll / 2))
        nic = 2 * L * nbytes * (P - L) / P
        shm = 2 * L * nbytes * (L - 1) / P
    yield host.engine.start(host.transfer(name, nic, shm, cpu_bytes=nic + shm))


def sparse_allgather(host: Host, pairs: float, name: str = "topk allgather"):
    """Flat top-k: every rank's `pairs` (index, value) pairs round the world ring."""
    yield from allgather(host, pairs * PAIR_BYTES, name, native=True)


def hierarchical_sparse(host: Host, dense_bytes: float, pairs: float, select, name: str = "hier-topk"):
    """MSTopK's four steps; `select(elements)` is the process selecting from this rank's shard."""
    c = host.cluster
    L, N = c.ranks_per_node, c.nodes
    if L > 1:  # 1. reduce-scatter inside the node: shared memory only
        yield host.engine.timeout((L - 1) * c.latency)
        per_rank = (L - 1) / L * dense_bytes
        yield host.engine.start(host.transfer(f"{name} node reduce-scatter", 0.0, (L - 1) * per_rank,
                                              cpu_bytes=L * per_rank))
    yield from select(dense_bytes / 4 / L)  # 2. select from the shard
    if N > 1:  # 3. L cross allgathers in parallel, k/L pairs per rank, one per node on each
        yield host.engine.timeout((N - 1) * c.latency)
        per_rank = (N - 1) * pairs / L * PAIR_BYTES
        yield host.engine.start(host.transfer(f"{name} cross allgather", L * per_rank, 0.0, cpu_bytes=L * per_rank))
    if L > 1:  # 4. allgather inside the node of the N·k/L pairs each rank holds
        yield host.engine.timeout((L - 1) * c.latency)
        per_rank = (L - 1) * N * pairs / L * PAIR_BYTES
        yield host.engine.start(host.transfer(f"{name} node allgather", 0.0, (L - 1) * per_rank,
                                              cpu_bytes=L * per_rank))


class Stream:
    """Exchanges that one progress thread (or gloo's worker) runs one after another, in submission order;
    the host's progress threads poll (Host.polling) while any is pending."""

    def __init__(self, host: Host):
        self.host = host
        self._queue: deque = deque()
        self._busy = False

    def submit(self, gen) -> Event:
        """Queue the process `gen`; the event fires when it has run."""
        done = Event()
        self._queue.append((gen, done))
        if not self._busy:
            self._next()
        return done

    def _next(self) -> None:
        if not self._queue:
            self._busy = False
            self.host.polling(False)
            return
        if not self._busy:
            self.host.polling(True)
        self._busy = True
        gen, done = self._queue.popleft()

        def finished(_):
            done.succeed()
            self._next()

        self.host.engine.process(gen).then(finished)
