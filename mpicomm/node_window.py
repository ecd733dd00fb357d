"""P3's pushes and results inside a node through one MPI-3 shared window: a slice is copied, never sent."""

# Each rank's segment of its node's window holds, in slice order, the slices it
# pushes to its node's aggregators (every slice of which it is not the
# aggregator). Every rank of the node computes every segment's layout from the
# plan, so nothing but zero-byte notices travels as messages:
#
#     pusher q                               aggregator a (same node)
#     put(s): its slice -> q's segment       ...
#     notice (0 bytes, push tag) ----------> sums q's segment in place (source view)
#                                            writes the average into q's segment
#     get(s): q's segment -> its slice <---- notice (0 bytes, result tag)
#
# Why: without a single-copy path (MPICH's CMA, off where Yama's ptrace_scope
# is not 0, as on Ubuntu), a large shared-memory message moves a cell per
# progress call and its rank's network module is polled only when shared memory
# made no progress, so polls that sleep between them stalled p3's exchange
# (4.4-26 s a step against 1.4 s at 4 hosts x 2; benchmarks/topology.md). Win_sync
# orders the copies against the notices (MPI's unified memory model).

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

if TYPE_CHECKING:  # imported where the window is built: node_stage's NOTICE must not cost torch's import
    import torch

__all__ = ["NOTICE", "NodeWindow", "pushed_to_node"]

NOTICE = np.empty(0, dtype=np.uint8)  # a zero-byte message's buffer


def pushed_to_node(plan, rank: int) -> list[int]:
    """The slices `rank` pushes to an aggregator of its own node (all it does not aggregate), in order."""
    node = next(n for n in plan.nodes if rank in n)
    return [s for s, up in enumerate(plan.routes(rank)[1]) if up in node]


class NodeWindow:
    """One node's shared window over `comm`'s ranks of this rank's node (plan.nodes).

    Collective over `comm` (every rank builds it, in the same order). Raises
    RuntimeError on every rank when any rank could not allocate its segment.
    """

    def __init__(self, comm: MPI.Comm, plan, wire: list[np.ndarray], dtypes: list[torch.dtype]):
        rank = comm.Get_rank()
        node = next(n for n in plan.nodes if rank in n)
        self.node = comm.Split(plan.nodes.index(node), node.index(rank))
        self.win = None
        problem = None
        try:
            offsets = {q: self._layout(pushed_to_node(plan, q), wire) for q in node}
            size = max((a + wire[s].nbytes for s, a in offsets[rank].items()), default=0)
            self.win = MPI.Win.Allocate_shared(max(size, 1), 1, comm=self.node)
        except MPI.Exception as exc:
            problem = exc
        failed = comm.allreduce(problem is not None, op=MPI.LOR)
        if failed:
            self.free(clean=False)
            raise RuntimeError(f"rank {rank}: no MPI-3 shared window for p3's node part "
                               f"({problem or 'another rank could not allocate one'})")
        import torch

        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch for the whole run: Win_sync needs one
        self.mine: dict[int, np.ndarray] = {}  # slice -> this rank's staging bytes
        self.peers: dict[int, dict[int, torch.Tensor]] = {}  # peer -> slice -> its staged slice, typed
        for q in node:
            mem, _ = self.win.Shared_query(node.index(q))
            seg = np.frombuffer(mem, dtype=np.uint8)
            for s, a in offsets[q].items():
                view = seg[a:a + wire[s].nbytes]
                if q == rank:
                    self.mine[s] = view
                else:
                    self.peers.setdefault(q, {})[s] = torch.from_numpy(view).view(dtypes[s])

    @staticmethod
    def _layout(slices: list[int], wire) -> dict[int, int]:
        at, out = 0, {}
        for s in slices:  # each slice at a multiple of 64 bytes: any dtype's view, whole cache lines
            out[s] = at
            at += -(-wire[s].nbytes // 64) * 64
        return out

    def put(self, s: int, data: np.ndarray) -> None:
        """Before the push notice: this rank's slice s into its segment."""
        np.copyto(self.mine[s], data)
        self.win.Sync()

    def source(self, q: int, s: int) -> torch.Tensor:
        """Node peer q's staged slice s (read after its push notice and a sync)."""
        return self.peers[q][s]

    def write_result(self, q: int, s: int, average: torch.Tensor) -> None:
        """Before the result notice to q: the average into q's segment, where its push lay."""
        self.peers[q][s].copy_(average)
        self.win.Sync()

    def get(self, s: int, out: np.ndarray) -> None:
        """After the result notice: the average from this rank's segment into its slice."""
        self.win.Sync()
        np.copyto(out, self.mine[s])

    def sync(self) -> None:
        self.win.Sync()

    def free(self, clean: bool = True) -> None:
        """Win_free synchronizes the node: after an error (a peer may be gone) the window is left to the
        process's end instead, as freed requests are (mpicomm.requests)."""
        if self.win is not None and clean:
            self.mine, self.peers = {}, {}
            self.win.Unlock_all()
            self.win.Free()
            self.win = None
        if self.node != MPI.COMM_NULL:
            self.node.Free()
