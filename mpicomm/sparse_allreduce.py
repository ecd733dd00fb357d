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

Staged (a GPU model; `staged=True`, or any x off the CPU): x and out live on
the device and MPI works on host memory. The selection runs on the device
and only its packed (index, value) pairs cross to the host (one copy into a
pinned buffer that grows to the largest k seen); the exchange runs on the
host as above, and one copy takes every rank's pairs back to the device,
where they are summed into `out`. The hierarchical exchange must first bring
the dense x to the host for the node reduce-scatter (MPI here is not
CUDA-aware) and takes its shard back for the selection.
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
                 policy: StallPolicy | None = None, interrupt=None, staged: bool = False):
        self.hierarchical, self.staged = hierarchical, staged
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
        self._no_indices = torch.empty(0, dtype=torch.int64)
        self.applied = self._no_indices  # indices the last result may be nonzero at
        self.pairs = 0  # (index, value) pairs the last call gathered, every rank's
        self._add = False  # this call's `add`
        self._gather_only = False  # this call's `gather_only`
        self._scratch: dict = {}
        self._handles: list = []
        self._staging: dict = {}  # grow-only host (pinned for CUDA) and device buffers of the staged path
        self._pin = False  # host staging buffers are pinned when the device is a GPU
        self._copied = None  # CUDA event after the last copy out of the host buffers (they are reused)

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
                 k_of: Callable[[int], int] | None = None, host: torch.Tensor | None = None,
                 add: bool = False, gather_only: bool = False) -> torch.Tensor:
        """Dense sum over ranks of select(...) applied to `x` (flat) or to this rank's node-summed shard.

        out: where the sum goes (may be x itself: x is not read after the selection).
        k_of(n): how many entries `select` keeps of n; with it the hierarchical
        exchange knows every shard's selection size without exchanging sizes.
        host: staged only, a host tensor like x (pinned for CUDA) that the
        hierarchical exchange may overwrite with x's dense copy instead of a
        buffer of its own (the strategies pass their unused host mirror).
        add: the sum is added to what `out` holds, with no pass that zeroes it first (a caller that accounts for
        that pass elsewhere: an emulated device's modelled memset).
        gather_only: every rank's pairs are exchanged but not summed, and `out` is not written (an emulated
        device, whose sum is modelled time: `pairs` says how many it would add).
        """
        self._add, self._gather_only = add, gather_only
        if x.dim() != 1 or not x.is_contiguous():
            raise ValueError("sparse allreduce takes a contiguous 1-D tensor")
        if x.element_size() == 4 and x.numel() > 2**31 - 1:
            # Indices travel at the values' width (one packed buffer): int32 for float32.
            raise ValueError(f"{x.numel()} elements do not fit int32 indices: sparsify per layer "
                             "(granularity='layer') or in float64")
        if out is None:
            out = self._buffer("out", x.numel(), x.dtype) if x.device.type == "cpu" else torch.empty_like(x)
        if out.device != x.device:
            raise ValueError(f"out is on {out.device} but x on {x.device}")
        if self.staged or x.device.type != "cpu":
            self._settle()
            self._pin = x.device.type == "cuda"
            if self.hierarchical:
                return self._hierarchical_staged(x, select, out, k_of, host)
            return self._flat_staged(x, select, out)
        return self._hierarchical(x, select, out, k_of) if self.hierarchical else self._flat(x, select, out)

    def _sum(self, out: torch.Tensor, gathered: torch.Tensor, blocks: list[int], dtype: torch.dtype) -> torch.Tensor:
        """Every rank's pairs (packed blocks of these byte sizes) summed into `out`, unless the call gathers only."""
        self.pairs = sum(blocks) // (2 * dtype.itemsize)
        if self._gather_only:
            self.applied = self._no_indices.to(out.device)  # no allocation per call on the host
            return out
        if not self._add:
            out.zero_()
        self.applied = _scatter_add(out, gathered, blocks, dtype)
        return out

    def _pack(self, name: str, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return pack(values, indices, self._buffer(name, 2 * values.numel() * values.element_size(), torch.uint8))

    # -- flat ------------------------------------------------------------------
    def _flat(self, x: torch.Tensor, select: Select, out: torch.Tensor) -> torch.Tensor:
        mine = self._pack("mine", *_select(select, x))
        # Equal k everywhere is part of the contract (agreed when the strategy was built).
        gathered = self._run(self.world.allgather(mine, self._buffer("gathered", mine.numel() * self.size,
                                                                     torch.uint8)))
        self.traffic.add(mine.numel() * (self.size - 1), self._right_is_remote)
        return self._sum(out, gathered, [mine.numel()] * self.size, x.dtype)

    # -- hierarchical -------------------------------------------------------------
    def _hierarchical(self, x: torch.Tensor, select: Select, out: torch.Tensor, k_of) -> torch.Tensor:
        node = self.node
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
        blocks, everything = self._spread(mine, counts, 2 * x.element_size(), k_of, self._buffer)
        return self._sum(out, everything, blocks, x.dtype)

    def _spread(self, mine: torch.Tensor, counts: list[int], width: int, k_of, buffer):
        """Steps 3 and 4 of the hierarchical exchange: (blocks, every rank's pairs), in host buffers from `buffer`."""
        node, cross = self.node, self.cross
        L, j = node.size, node.rank
        # 3. allgather the selections across nodes (equal k: same shard length everywhere).
        if cross.size > 1:
            gathered = self._run(cross.allgather(mine, buffer("gathered", mine.numel() * cross.size, torch.uint8)))
            self.traffic.add(mine.numel() * (cross.size - 1), True)
        else:
            gathered = mine
        # 4. node allgather of those (index, value) pairs as they are: no pass looks for nonzeros, and
        # when the caller says how many entries a shard of each length keeps, no sizes are exchanged.
        if L > 1:
            if k_of is not None:
                sizes = [width * (k_of(c) if c else 0) * cross.size for c in counts]
            else:
                table = self._buffer("sizes", L, torch.int64)
                sizes = self._run(node.allgather(torch.tensor([gathered.numel()]), table)).tolist()
            everything = self._run(node.allgatherv(gathered, buffer("node", sum(sizes), torch.uint8), counts=sizes))
            # A ring allgather forwards every block except the right neighbour's own.
            self.traffic.add(sum(sizes) - sizes[(j + 1) % L], False)
        else:
            sizes, everything = [gathered.numel()], gathered
        return [size // cross.size for size in sizes for _ in range(cross.size)], everything

    # -- staged: x and out on a device, MPI on host memory ----------------------------------
    def _stage(self, name: str, n: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        """A grow-only buffer of at least n: on `device`, or on the host (None; pinned beside a CUDA device)."""
        key = (name, dtype, device)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < n:
            if device is not None:
                buf = torch.empty(n, dtype=dtype, device=device)
            else:
                buf = torch.empty(n, dtype=dtype, pin_memory=self._pin)
            self._staging[key] = buf
        return buf[:n]

    def _settle(self) -> None:
        """Before the host buffers are written again: the last asynchronous copy out of them has finished."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def _to_host(self, name: str, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Pack the selection on its device, then one copy to the host (it waits for the selection)."""
        device = values.device
        nbytes = 2 * values.numel() * values.element_size()
        packed = pack(values, indices, self._stage(name, nbytes, torch.uint8, device))
        return self._stage(name, nbytes, torch.uint8).copy_(packed)

    def _add_on_device(self, out: torch.Tensor, gathered: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        """One copy of every rank's pairs to out's device, summed there in rank order (as `_scatter_add`)."""
        if self._gather_only:  # nothing to sum: the pairs need not cross to the device
            return self._sum(out, gathered, blocks, out.dtype)
        pairs = self._stage("pairs", gathered.numel(), torch.uint8, out.device)
        pairs.copy_(gathered, non_blocking=True)  # from pinned memory: queued, the host goes on
        if out.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self._sum(out, pairs, blocks, out.dtype)

    def _flat_staged(self, x: torch.Tensor, select: Select, out: torch.Tensor) -> torch.Tensor:
        mine = self._to_host("mine", *_select(select, x))
        gathered = self._run(self.world.allgather(mine, self._stage("gathered", mine.numel() * self.size,
                                                                    torch.uint8)))
        self.traffic.add(mine.numel() * (self.size - 1), self._right_is_remote)
        return self._add_on_device(out, gathered, [mine.numel()] * self.size)

    def _hierarchical_staged(self, x: torch.Tensor, select: Select, out: torch.Tensor, k_of,
                             host: torch.Tensor | None) -> torch.Tensor:
        node = self.node
        L, j = node.size, node.rank
        counts = block_counts(x.numel(), L)
        lo = offsets(counts)[j]
        if L > 1:
            # The node's dense reduce-scatter runs on the host: the whole x crosses once, the shard comes back.
            if host is None or host.shape != x.shape or host.dtype != x.dtype or host.device.type != "cpu":
                host = self._stage("dense", x.numel(), x.dtype)
            dense = host.copy_(x)
            shard_host = self._stage("shard", counts[j], x.dtype)
            self._run(node.reduce_scatter(dense, shard_host))
            self.traffic.add((x.numel() - counts[j]) * x.element_size(), False)
            shard = self._stage("shard", counts[j], x.dtype, x.device).copy_(shard_host)
        else:
            shard = x
        values, indices = _select(select, shard)
        mine = self._to_host("mine", values, indices + lo)
        blocks, everything = self._spread(mine, counts, 2 * x.element_size(), k_of, self._stage)
        return self._add_on_device(out, everything, blocks)


def _select(select: Select, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's selection, except that an empty vector (a small tensor's empty shard) selects nothing."""
    if x.numel() == 0:
        return x, torch.empty(0, dtype=torch.int64, device=x.device)
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
    return torch.cat(touched) if touched else torch.empty(0, dtype=torch.int64, device=out.device)
