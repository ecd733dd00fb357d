"""Top-k sparse allreduce: flat allgather of (index, value) pairs, or MSTopK's hierarchical four steps.

Both return the dense sum over ranks of what each selection kept. The
selection itself is a callable from the caller (`select(x) -> (values,
indices)`), so error feedback and the choice of top-k operator stay in the
training runtime; this module only moves and sums.

Flat: every rank selects from its whole vector and the (index, value) lists
go round the world ring. Hierarchical (for slow links between nodes):
  1. reduce-scatter the dense vector inside the node: local rank j holds
     shard j of the node's sum;
  2. select from that shard;
  3. allgather the selections among the ranks holding shard j on every node
     (the cross communicator);
  4. allgather those (index, value) pairs inside the node; every rank sums
     all of them, in the same order.
Only step 3 crosses nodes, carrying k/L entries per rank instead of flat's k
per rank through every ring hop.
"""

from __future__ import annotations

from typing import Callable

import torch

from .buffers import block_counts, offsets
from .ring import Ring
from .stall import DRIVE, StallPolicy, wait_until
from .topology import Topology

Select = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
INDEX_DTYPES = {4: torch.int32, 8: torch.int64}  # index width follows the value width: one packed buffer


def pack(values: torch.Tensor, indices: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(values, indices) as one byte tensor [indices | values], indices stored at the values' width."""
    k, width = values.numel(), values.element_size()
    if width not in INDEX_DTYPES:
        raise TypeError(f"sparse allreduce needs 4- or 8-byte values, got {values.dtype}")
    if out is None:
        out = torch.empty(2 * k * width, dtype=torch.uint8)
    out[:k * width].view(INDEX_DTYPES[width]).copy_(indices)
    out[k * width:].view(values.dtype).copy_(values)
    return out


def unpack(packed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack`: (values, indices) views of one packed block."""
    width = torch.empty(0, dtype=dtype).element_size()
    k = packed.numel() // (2 * width)
    return packed[k * width:].view(dtype), packed[:k * width].view(INDEX_DTYPES[width])


class Traffic:
    """Bytes this rank has sent, split by whether the receiver is on its own node."""

    __slots__ = ("intra", "inter")

    def __init__(self):
        self.intra = self.inter = 0

    def add(self, nbytes: int, inter: bool) -> None:
        if inter:
            self.inter += nbytes
        else:
            self.intra += nbytes


class SparseAllreduce:
    """Sum over ranks of each rank's sparse selection; flat or hierarchical over a Topology.

    The topology's communicators are duplicated (rings), so this object's
    traffic never mixes with the caller's. `traffic` counts bytes sent to
    peers on the same node and on other nodes, as the algorithms send them.
    Every buffer (packed selections, gathered blocks, the dense result unless
    the caller passes `out`) is kept for the next call of the same size:
    freshly allocated 100 MB tensors cost page faults on every step.
    """

    def __init__(self, topology: Topology, *, hierarchical: bool, validate: bool | None = None,
                 policy: StallPolicy | None = None, interrupt=None):
        self.hierarchical = hierarchical
        self.policy, self.interrupt, self.rank = policy, interrupt, topology.rank
        self.size = topology.size
        if hierarchical:
            self.node, self.cross = Ring(topology.node, validate=validate), Ring(topology.cross, validate=validate)
            self.rings = [self.node, self.cross]
        else:
            self.world = Ring(topology.world, validate=validate)
            self.rings = [self.world]
            right = (topology.rank + 1) % topology.size
            self._right_is_remote = right not in topology.node_ranks
        self.traffic = Traffic()
        self.applied = torch.empty(0, dtype=torch.int64)  # indices the last result may be nonzero at
        self._scratch: dict = {}
        self._handles: list = []

    def _buffer(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._scratch.get((name, dtype))
        if buf is None or buf.numel() != n:
            buf = self._scratch[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buf

    def free(self) -> None:
        for ring in self.rings:
            ring.free()
        self.rings = []

    def cancel(self) -> None:
        """Error path: cancel a collective left in flight."""
        for h in self._handles:
            h.cancel()
        self._handles = []

    def _run(self, handle):
        self._handles = [handle]
        wait_until(handle.test, what=f"sparse allreduce ({handle.name})", policy=self.policy,
                   who=f"rank {self.rank}: ", interrupt=self.interrupt, spin=DRIVE)
        self._handles = []
        return handle.wait()

    def __call__(self, x: torch.Tensor, select: Select, out: torch.Tensor | None = None,
                 k_of: Callable[[int], int] | None = None) -> torch.Tensor:
        """Dense sum over ranks of select(...) applied to `x` (flat) or to this rank's node-summed shard.

        out: where the sum goes (may be x itself: x is not read after the selection).
        k_of(n): how many entries `select` keeps of n; with it the hierarchical
        exchange knows every shard's selection size without exchanging sizes.
        """
        if x.dim() != 1 or not x.is_contiguous():
            raise ValueError("sparse allreduce takes a contiguous 1-D tensor")
        if x.element_size() == 4 and x.numel() > 2**31 - 1:
            # Indices travel at the values' width (one packed buffer): int32 for float32.
            raise ValueError(f"{x.numel()} elements do not fit int32 indices: sparsify per layer "
                             "(granularity='layer') or in float64")
        if out is None:
            out = self._buffer("out", x.numel(), x.dtype)
        return self._hierarchical(x, select, out, k_of) if self.hierarchical else self._flat(x, select, out)

    def _pack(self, name: str, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return pack(values, indices, self._buffer(name, 2 * values.numel() * values.element_size(), torch.uint8))

    # -- flat ------------------------------------------------------------------
    def _flat(self, x: torch.Tensor, select: Select, out: torch.Tensor) -> torch.Tensor:
        mine = self._pack("mine", *_select(select, x))
        # Equal k everywhere is part of the contract (agreed when the strategy was built).
        gathered = self._run(self.world.allgather(mine, self._buffer("gathered", mine.numel() * self.size,
                                                                     torch.uint8)))
        self.traffic.add(mine.numel() * (self.size - 1), self._right_is_remote)
        out.zero_()
        self.applied = _scatter_add(out, gathered, [mine.numel()] * self.size, x.dtype)
        return out

    # -- hierarchical -------------------------------------------------------------
    def _hierarchical(self, x: torch.Tensor, select: Select, out: torch.Tensor, k_of) -> torch.Tensor:
        node, cross = self.node, self.cross
        L, j = node.size, node.rank
        counts = block_counts(x.numel(), L)
        lo = offsets(counts)[j]
        # 1. node reduce-scatter: shard j of the node's sum.
        if L > 1:
            shard = self._buffer("shard", counts[j], x.dtype)
            self._run(node.reduce_scatter(x, shard))
            self.traffic.add((x.numel() - counts[j]) * x.element_size(), False)
        else:
            shard = x
        # 2. select within the shard; indices shifted to the whole vector's positions.
        values, indices = _select(select, shard)
        mine = self._pack("mine", values, indices + lo)
        # 3. allgather the selections across nodes (equal k: same shard length everywhere).
        if cross.size > 1:
            gathered = self._run(cross.allgather(mine, self._buffer("gathered", mine.numel() * cross.size,
                                                                    torch.uint8)))
            self.traffic.add(mine.numel() * (cross.size - 1), True)
        else:
            gathered = mine
        # 4. node allgather of those (index, value) pairs as they are: no pass looks for nonzeros, and
        # when the caller says how many entries a shard of each length keeps, no sizes are exchanged.
        width = 2 * x.element_size()
        if L > 1:
            if k_of is not None:
                sizes = [width * (k_of(c) if c else 0) * cross.size for c in counts]
            else:
                table = self._buffer("sizes", L, torch.int64)
                sizes = self._run(node.allgather(torch.tensor([gathered.numel()]), table)).tolist()
            everything = self._run(node.allgatherv(gathered, self._buffer("node", sum(sizes), torch.uint8),
                                                   counts=sizes))
            # A ring allgather forwards every block except the right neighbour's own.
            self.traffic.add(sum(sizes) - sizes[(j + 1) % L], False)
        else:
            sizes, everything = [gathered.numel()], gathered
        out.zero_()
        blocks = [size // cross.size for size in sizes for _ in range(cross.size)]
        self.applied = _scatter_add(out, everything, blocks, x.dtype)
        return out


def _select(select: Select, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's selection, except that an empty vector (a small tensor's empty shard) selects nothing."""
    if x.numel() == 0:
        return x, torch.empty(0, dtype=torch.int64)
    return select(x)


def _scatter_add(out: torch.Tensor, gathered: torch.Tensor, blocks: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Add the packed (index, value) blocks, of these byte sizes, into the dense `out`; returns their indices.

    The blocks are summed in rank order, the same on every rank, so every
    rank ends with bit-identical sums.
    """
    start, touched = 0, []
    for size in blocks:
        if size:
            vals, idx = unpack(gathered[start:start + size], dtype)
            idx = idx.long()
            out.index_put_((idx,), vals, accumulate=True)
            touched.append(idx)
        start += size
    return torch.cat(touched) if touched else torch.empty(0, dtype=torch.int64)
