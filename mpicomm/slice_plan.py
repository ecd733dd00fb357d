"""P3's slice plan: which elements each slice covers, the tensors it touches, its owner, its route and its tags."""

from __future__ import annotations

from mpi4py import MPI

from .tags import check_tag

__all__ = ["SlicePlan"]


class SlicePlan:
    """Which elements each slice covers, which tensors it touches, who owns it, and its tags.

    buffer_sizes[b]: elements of flat buffer b; segments[t] = (b, start, stop):
    where tensor t lives. Slice s is elements [start, stop) of buffer
    slices[s][0].
    """

    def __init__(self, buffer_sizes: list[int], segments: list[tuple[int, int, int]], slice_size: int,
                 ranks: int, comm: MPI.Comm, nodes: list[list[int]] | None = None):
        if not isinstance(slice_size, int) or slice_size < 1:
            raise ValueError(f"slice_size must be an integer >= 1, got {slice_size!r}")
        count = sum(-(-n // slice_size) for n in buffer_sizes)
        if count:  # before any list is built: a plan too large for the tags would exhaust memory first
            check_tag(comm, 2 * count - 1)  # push tags 0..S-1, result tags S..2S-1
        self.slices: list[tuple[int, int, int]] = []
        for b, n in enumerate(buffer_sizes):
            self.slices += [(b, a, min(a + slice_size, n)) for a in range(0, n, slice_size)]
        self.count = len(self.slices)
        self.ranks = ranks
        # Two levels only when both have more than one rank: otherwise node aggregation is the flat exchange.
        self.nodes = nodes if nodes and len(nodes) > 1 and len(nodes[0]) > 1 else None
        first = {}
        for s, (b, a, _) in enumerate(self.slices):
            first.setdefault(b, s)
        self.slices_of: list[list[int]] = []  # tensor -> slices covering it
        self.tensors_of: list[list[int]] = [[] for _ in range(self.count)]  # slice -> tensors it touches
        for t, (b, a, z) in enumerate(segments):
            ids = list(range(first[b] + a // slice_size, first[b] + (z - 1) // slice_size + 1)) if z > a else []
            self.slices_of.append(ids)
            for s in ids:
                self.tensors_of[s].append(t)

    def owner(self, s: int) -> int:
        """The rank that averages slice s over every rank."""
        if self.nodes is None:
            return s % self.ranks
        L, N = len(self.nodes[0]), len(self.nodes)
        return self.nodes[(s // L) % N][s % L]

    def routes(self, rank: int) -> tuple[list[list[int]], list[int | None], list[list[int]]]:
        """Per slice, for `rank`: whose pushes it sums (sources), whom it pushes the sum to (upstream, None:
        it is the owner) and whom it sends the average to (downstream)."""
        sources, upstream, downstream = [], [], []
        for s in range(self.count):
            owner = self.owner(s)
            if self.nodes is None:
                peers = [p for p in range(self.ranks) if p != rank] if rank == owner else []
                sources.append(peers)
                upstream.append(None if rank == owner else owner)
                downstream.append(peers)
                continue
            L = len(self.nodes[0])
            node = next(n for n in self.nodes if rank in n)
            aggregator = node[s % L]
            mates = [p for p in node if p != rank] if rank == aggregator else []
            if rank == owner:  # also its node's aggregator: the node's ranks and the other nodes' aggregators
                mates = mates + [n[s % L] for n in self.nodes if n is not node]
            sources.append(mates)
            downstream.append(mates)
            upstream.append(None if rank == owner else owner if rank == aggregator else aggregator)
        return sources, upstream, downstream

    def push_tag(self, s: int) -> int:
        return s

    def result_tag(self, s: int) -> int:
        return self.count + s
