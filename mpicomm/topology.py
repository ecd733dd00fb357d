"""Who runs where: world, node (same host) and cross (same local rank on every node) communicators."""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

ENV_RANKS_PER_NODE = "MPITRAIN_RANKS_PER_NODE"


class TopologyError(ValueError):
    """The requested or detected layout of ranks onto nodes is unusable; raised on every rank."""


def _env_ranks_per_node() -> int | None:
    raw = os.environ.get(ENV_RANKS_PER_NODE, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        return -1  # reported collectively below, with the other ranks' values


class Topology:
    """The communicators a hierarchical algorithm needs, created collectively and owned by this object.

    node: ranks sharing a host (Split_type SHARED), or consecutive blocks of
    `ranks_per_node` world ranks to emulate several nodes on one host
    (argument, else $MPITRAIN_RANKS_PER_NODE).
    cross: one rank per node, those with the same local rank, ordered by node.
    Every node must hold the same number of ranks, as hierarchical
    collectives assume. All three communicators are private duplicates: free
    them with `free()` or a `with` block.
    """

    def __init__(self, comm: MPI.Comm = MPI.COMM_WORLD, ranks_per_node: int | None = None):
        self.world = comm.Dup()
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        self.node = self.cross = MPI.COMM_NULL
        try:
            self._build(ranks_per_node if ranks_per_node is not None else _env_ranks_per_node())
        except TopologyError:
            self.free()
            raise

    def _build(self, rpn: int | None) -> None:
        # Agree on the requested layout first, so a rank with a different
        # environment cannot send the others down a different code path.
        asked = np.array([-2 if rpn is None else rpn], dtype=np.int64)
        everyone = np.empty(self.size, dtype=np.int64)
        self.world.Allgather(asked, everyone)
        if np.any(everyone != everyone[0]):
            shown = ", ".join(f"rank {r}: {'unset' if v == -2 else v}" for r, v in enumerate(everyone))
            raise TopologyError(f"ranks disagree on ranks_per_node ({shown}); set {ENV_RANKS_PER_NODE} "
                                "the same everywhere")
        if rpn is not None:
            if rpn <= 0:
                raise TopologyError(f"ranks_per_node must be a positive integer, got "
                                    f"{os.environ.get(ENV_RANKS_PER_NODE) if rpn == -1 else rpn}")
            if self.size % rpn:
                raise TopologyError(f"world size {self.size} is not divisible by ranks_per_node={rpn}")
            self.emulated = True
            self.node = self.world.Split(self.rank // rpn, self.rank)
        else:
            self.emulated = False
            self.node = self.world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = self.node.Get_rank(), self.node.Get_size()

        # A node is named by its lowest world rank; nodes are numbered in that order.
        leader = np.empty(1, dtype=np.int64)
        self.node.Allreduce(np.array([self.rank], dtype=np.int64), leader, op=MPI.MIN)
        leaders = np.empty(self.size, dtype=np.int64)
        self.world.Allgather(leader, leaders)
        sizes = np.empty(self.size, dtype=np.int64)
        self.world.Allgather(np.array([self.local_size], dtype=np.int64), sizes)
        if np.any(sizes != sizes[0]):
            layout = {int(l): int(s) for l, s in zip(leaders, sizes)}
            raise TopologyError(f"nodes hold different numbers of ranks (node leader: ranks {layout}); "
                                "hierarchical collectives need the same count on every node")
        order = sorted(set(leaders.tolist()))
        self.node_index, self.num_nodes = order.index(int(leader[0])), len(order)
        self.nodes = [[r for r in range(self.size) if leaders[r] == l] for l in order]
        self.cross = self.world.Split(self.local_rank, self.node_index)

    @property
    def node_ranks(self) -> list[int]:
        """World ranks on this rank's node, in local-rank order."""
        return self.nodes[self.node_index]

    def free(self) -> None:
        for name in ("cross", "node", "world"):
            comm = getattr(self, name)
            if comm != MPI.COMM_NULL:
                comm.Free()
            setattr(self, name, MPI.COMM_NULL)

    def __enter__(self) -> "Topology":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        return (f"<Topology rank {self.rank}/{self.size} node {self.node_index}/{self.num_nodes} "
                f"local {self.local_rank}/{self.local_size}{' emulated' if self.emulated else ''}>")
