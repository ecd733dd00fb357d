"""Topology-aware allreduce behind the Ring's Handles: flat ring, doubling or hierarchical, chosen per call."""

#     coll = Collectives(Topology())                    # algorithm="auto": by size, nodes and ranks per node
#     coll.allreduce(grad, tag=b).wait()                # non-blocking like Ring.allreduce; tags as the Ring's
#     coll.algorithm_for(grad.nbytes)                   # "ring" | "doubling" | "rabenseifner" | "hierarchical"
#
# On nodes of several ranks placed node by node, an in-place reduce-scatter and an
# in-place allgatherv (PTO's pair) take the hierarchy too, keeping the flat ring's
# blocks (block r on world rank r); otherwise they, allgather and broadcast are
# the flat Ring's (`coll.flat`).
# Every rank must be built with the same algorithm settings (checked at once,
# on every rank). With validation, each allreduce first exchanges a
# fingerprint that includes the algorithm the rank picked, so ranks that would
# take different paths (different lengths, say) fail together instead of
# hanging on each other's messages.

from __future__ import annotations

import warnings
import zlib

import numpy as np
from mpi4py import MPI

from . import validate as V
from .agree import check_same_structure
from .algorithms import ALGORITHMS, Chooser, Layout
from .buffers import OP_CODES, Buffer, BufferError, allreduce_operands, block_counts
from .doubling import doubling_allreduce
from .halving import halving_allreduce
from .handle import Handle
from .hierarchical import (LANES, contiguous, hierarchical_allgather, hierarchical_allreduce,
                           hierarchical_reduce_scatter, pieces, pipelined)
from .node_stage import NodeStage
from .single_copy import single_copy
from .requests import RequestLog, drain_at_exit
from .ring import DEFAULT_CHUNK_BYTES, IN_PLACE, Ring
from .scratch import SCRATCH
from .ring_steps import ring_steps
from .topology import Topology

__all__ = ["Collectives"]

_CODES = {name: i + 1 for i, name in enumerate(ALGORITHMS)}
_NAMES = {code: name for name, code in _CODES.items()}
_ROOT = V.FIELDS.index("root")  # where a fingerprint carries the algorithm (unused by these kinds otherwise)
_ERROR = V.FIELDS.index("error")


class Collectives:
    """Allreduce over a Topology's world, node and cross communicators (private duplicates of each).

    algorithm, table, model: see mpicomm.algorithms.Chooser (model: a CostModel, e.g.
    CostModel.measured(topology), which probes the link). validate: as the Ring's
    (default $MPITRAIN_VALIDATE). node_window: True, the hierarchy's steps inside
    a node through an MPI-3 shared window per lane (mpicomm.node_stage; 8 MiB a
    rank each) instead of the node ring's messages; "auto" (the default): where
    any rank's MPI has no single-copy path for a node's large messages
    (mpicomm.single_copy), which is where the window is faster; where a node's
    ranks cannot share one, messages on every rank, with a warning. `rank`,
    `size`, `left` and `comm` are the world ring's, so code written for a Ring
    reads them alike.
    """

    def __init__(self, topology: Topology, *, algorithm: str | None = None, table=None, model=None,
                 validate: bool | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 node_window: bool | str = "auto"):
        problem, chooser = None, None
        layout = Layout(topology.size, topology.num_nodes, topology.local_size)
        try:
            chooser = Chooser(layout, algorithm, table, model)
            if node_window not in (True, False, "auto"):
                raise ValueError(f"node_window must be True, False or 'auto', got {node_window!r}")
        except ValueError as exc:
            problem = exc
        self.comm = drain_at_exit(topology.world.Dup())
        try:
            check_same_structure(self.comm, [f"error: {problem}"] if problem
                                 else [chooser.describe(), f"node_window={node_window}"], "allreduce setting")
        except Exception:
            self.comm.Free()
            raise
        if problem:  # the same bad setting on every rank: each raises it
            self.comm.Free()
            raise problem
        self.chooser, self.layout = chooser, layout
        self.validate = V.default_validate() if validate is None else bool(validate)
        two_levels = layout.hierarchical and chooser.algorithm in ("auto", "hierarchical")
        rings: list[Ring] = []

        def ring(comm, validate=False) -> Ring:
            rings.append(Ring(comm, validate=validate, chunk_bytes=chunk_bytes, latency_bytes=0))
            return rings[-1]

        try:
            self.flat = ring(topology.world, self.validate)
            self.node, self.cross = ring(topology.node), ring(topology.cross)
            # The pipelined hierarchy's pieces: one (node, cross) pair of communicators each, so that pieces of
            # one allreduce (same tag, same peers) never match each other's messages.
            self.lanes = [(self.node, self.cross)] + [(ring(topology.node), ring(topology.cross))
                                                      for _ in range(LANES - 1 if two_levels else 0)]
        except BaseException:
            for r in rings:
                r.free(drain=False)  # nothing sent on them yet, and a rank that raised here is not freeing
            self.comm.Free()
            raise
        self.rank, self.size, self.left = self.flat.rank, self.flat.size, self.flat.left
        if two_levels and node_window == "auto":  # any rank without the single copy: every rank takes the window
            node_window = self.comm.allreduce(single_copy(MPI.Get_library_version())[0] is not True, op=MPI.LOR)
        self.stages = self._stages(topology, len(self.lanes)) if two_levels and node_window else []
        # The hierarchical reduce-scatter and allgather: whenever the layout allows and the setting is not a
        # flat algorithm; decided without the message's size, so every rank takes the same path even when
        # their lengths differ (validation then names them).
        self.blocks_hierarchical = two_levels and contiguous(topology.nodes)
        self.counts = dict.fromkeys(ALGORITHMS, 0)  # allreduces started per algorithm (tests, reports)
        self._across: dict[int, str] = {}  # bytes -> the hierarchy's cross-node algorithm

    def algorithm_for(self, nbytes: int) -> str:
        return self.chooser.choose(int(nbytes))

    def across_for(self, nbytes: int) -> str:
        """The cross-node algorithm of a hierarchical allreduce of `nbytes` (each piece's; per size once, as the
        choice itself: buckets repeat their sizes every step)."""
        across = self._across.get(nbytes)
        if across is None:
            across = self._across[nbytes] = self.chooser.model.cross_algorithm(float(nbytes) / pieces(nbytes),
                                                                                self.layout)
        return across

    def _stages(self, topology: Topology, lanes: int) -> list[NodeStage]:
        """One NodeStage per lane, or none on every rank (a warning) where any rank could not allocate its own."""
        stages, problem = [], None
        try:
            for _ in range(lanes):
                stages.append(NodeStage(topology.node))
        except MPI.Exception as exc:
            problem = exc
        if not self.comm.allreduce(problem is not None, op=MPI.LOR):
            return stages
        for stage in stages:
            stage.free(clean=False)  # Win_free would wait for ranks that have no window
        warnings.warn(f"rank {self.rank}: no MPI-3 shared window for the hierarchy's node steps "
                      f"({problem or 'another rank could not allocate one'}): they go as messages")
        return []

    # -- lifecycle ---------------------------------------------------------
    def free(self, drain: bool = True) -> None:
        """Collective on every rank of the topology, as MPI_Comm_free: what calls cancelled on one side left queued
        is dropped first (Ring.free), not handed to MPI's next communicators; not on an error path (`drain`)."""
        for stage in self.stages:
            stage.free()
        self.stages = []
        for ring in [self.flat] + [r for lane in self.lanes for r in lane]:
            ring.free(drain)
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def __enter__(self) -> "Collectives":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.free(drain=exc_type is None)

    # -- collectives -------------------------------------------------------
    def allreduce(self, buf, out=None, *, op: str = "sum", tag: int | None = None) -> Handle:
        """Reduce `buf` across ranks into `out` (in place into `buf` when out is None), by the chosen algorithm."""
        log = RequestLog("allreduce")
        return Handle("allreduce", self._allreduce(buf, out, op, tag, log), log)

    def reduce_scatter(self, buf, out=None, *, op: str = "sum", tag: int | None = None) -> Handle:
        """As Ring.reduce_scatter; in place on two levels, by the hierarchy (the same blocks)."""
        if not self.blocks_hierarchical:
            return self.flat.reduce_scatter(buf, out, op=op, tag=tag)
        log = RequestLog("reduce_scatter")
        return Handle("reduce_scatter", self._reduce_scatter(buf, out, op, tag, log), log)

    def allgather(self, buf, out=None, *, tag: int | None = None) -> Handle:
        return self.flat.allgather(buf, out, tag=tag)

    def allgatherv(self, buf, out=None, *, counts=None, tag: int | None = None) -> Handle:
        """As Ring.allgatherv; with `out` and `counts` on two levels, by the hierarchy (without either, as the
        Ring does, the flat one: every rank must then leave one out too)."""
        if not self.blocks_hierarchical:
            return self.flat.allgatherv(buf, out, counts=counts, tag=tag)
        log = RequestLog("allgatherv")
        return Handle("allgatherv", self._allgatherv(buf, out, counts, tag, log), log)

    def broadcast(self, buf, root: int = 0, *, tag: int | None = None) -> Handle:
        return self.flat.broadcast(buf, root, tag=tag)

    # -- the algorithm -----------------------------------------------------
    def _allreduce(self, buf, out, op, tag, log):
        ring = self.flat
        src, dst, problem = allreduce_operands(buf, out, op)
        tag, problem = ring._tag(tag, problem)
        name = self.algorithm_for(src.count * src.itemsize) if src is not None else "ring"
        yield from self._agree("allreduce", src, op, tag, name, problem)
        if dst is not src:
            dst.copy_from(src)
        self.counts[name] += 1
        if name == "hierarchical":
            yield from self._hierarchical(dst, op, tag, log)
        elif name == "doubling":
            yield from doubling_allreduce(ring.comm, dst, op, tag, log)
        elif name == "rabenseifner":
            yield from halving_allreduce(ring.comm, dst, op, tag, log, ring.chunk_bytes)
        else:
            blocks = block_counts(dst.count, self.size)
            yield from ring_steps(ring, dst, blocks, range(0, 2 * self.size - 2), op, tag, log)
        return dst.obj

    def _stage(self) -> NodeStage | None:
        return self.stages[0] if self.stages else None

    def _hierarchical(self, dst: Buffer, op, tag, log):
        """Generator: `dst` in pieces, each on its own lane (and NodeStage, where the node steps take the window)."""
        nbytes = dst.count * dst.itemsize
        k, across = pieces(nbytes), self.across_for(nbytes)
        if k == 1:
            yield from hierarchical_allreduce(self.node, self.cross, dst, op, tag, log, across, self._stage())
        else:
            yield from pipelined(self.lanes[:k], dst, op, tag, log, across, self.stages[:k] or None)

    def _reduce_scatter(self, buf, out, op, tag, log):
        ring = self.flat
        src, problem = ring._wrap(buf, "buf")
        problem = problem or ring._check_op(op)
        counts = block_counts(src.count if src else 0, self.size)
        dst = None
        if out is not None and problem is None:
            dst, problem = ring._wrap(out, "out")
            if dst is not None and (dst.count != counts[self.rank] or dst.dtype != src.dtype):
                problem = BufferError(f"out has {dst.count} x {dst.dtype}, rank {self.rank} needs "
                                      f"{counts[self.rank]} x {src.dtype}")
        tag, problem = ring._tag(tag, problem)
        yield from self._agree("reduce_scatter", src, op, tag, "hierarchical", problem)
        lo = sum(counts[:self.rank])
        work = src
        if dst is not None:  # out of place leaves buf as it was: the partial sums go to a copy
            work = SCRATCH.take(src, src.count)
            work.copy_from(src)
        yield from hierarchical_reduce_scatter(self.node, self.cross, work, counts, op, tag, log, self._stage())
        if dst is None:
            return src.elements(lo, lo + counts[self.rank])
        dst.bytes()[...] = work.bytes(lo, lo + counts[self.rank])
        SCRATCH.give(work)  # only once done: a cancelled exchange may still have a receive posted into it
        return dst.obj

    def _allgatherv(self, buf, out, counts, tag, log):
        ring = self.flat
        explicit = tag is not None
        tag, problem = ring._tag(tag, None)  # first, one tag on either path: every rank's allocator stays in step
        if out is None or counts is None:
            # The flat ring's, on its own communicator: agreed here first, so that a rank that passed both (the
            # hierarchy, on this one) is named instead of waited for. An automatic tag is the ring's own to take.
            yield from self._agree("allgatherv", None, "sum", 0, "ring", problem)
            return (yield from ring._allgather(buf, out, counts, tag if explicit else None, "allgatherv", log))
        dst, wrapped = ring._wrap(out, "out")
        problem = problem or wrapped
        counts = [int(c) for c in counts]
        if problem is None and (len(counts) != self.size or min(counts) < 0 or sum(counts) != dst.count):
            problem = ValueError(f"counts must list {self.size} non-negative lengths summing to out's "
                                 f"{dst.count} elements, got {counts}")
        src = None
        if buf is not IN_PLACE and problem is None:
            src, problem = ring._wrap(buf, "buf")
            if src is not None and (src.count != counts[self.rank] or src.dtype != dst.dtype):
                problem = BufferError(f"counts[{self.rank}]={counts[self.rank]} x {dst.dtype}, but buf has "
                                      f"{src.count} x {src.dtype}")
        yield from self._agree("allgatherv", dst, "sum", tag, "hierarchical", problem,
                               extra=zlib.crc32(np.asarray(counts, dtype=np.int64).tobytes()))
        if src is not None:
            dst.copy_from(src, sum(counts[:self.rank]))
        yield from hierarchical_allgather(self.node, self.cross, dst, counts, tag, log, self._stage())
        return dst.obj

    def _agree(self, kind: str, ref: Buffer | None, op: str, tag: int, name: str, problem, extra: int = 0):
        """Generator step: fingerprints (the algorithm in `root`); every rank raises the same error, or none.

        Unvalidated (or alone), only this rank's own problem raises, without any exchange."""
        if not self.validate or self.size == 1:
            if problem:
                raise problem
            return
        mine = V.fingerprint(kind, dtype=ref.dtype_code if ref else 0, op=OP_CODES.get(op, 0), root=_CODES[name],
                             tag=tag, count=ref.count if ref else 0, extra=extra, error=problem is not None)
        table = yield from V.exchange(self.comm, mine)
        if problem:
            raise type(problem)(f"{kind}: {problem}")
        if V.agreed(table):
            return
        paths = table[:, _ROOT]
        if kind == "allgatherv" and not table[:, _ERROR].any() and (paths != paths[0]).any():  # the arguments chose
            shown = ", ".join(f"rank {r}: {'out and counts' if c == _CODES['hierarchical'] else 'not both'}"
                              for r, c in enumerate(paths))
            raise V.CollectiveMismatchError(f"allgatherv: every rank passes out and counts, or every rank leaves "
                                            f"one out ({shown})")
        others = table.copy()
        others[:, _ROOT] = table[0, _ROOT]
        V.check(kind, others)  # what else differs (a length, say) is named first: it is why the choice differs
        shown = ", ".join(f"rank {r}: {_NAMES.get(int(c), c)}" for r, c in enumerate(table[:, _ROOT]))
        raise V.CollectiveMismatchError(f"{kind}: ranks chose different algorithms ({shown}); "
                                        "build Collectives with the same settings everywhere")
