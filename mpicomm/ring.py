"""Ring collectives on Isend/Irecv: reduce-scatter, allgather(v), allreduce and pipelined broadcast."""

# Every call returns a Handle at once; data moves as the handle is tested or
# waited on, so several collectives (on distinct tags) can be in flight while
# the caller computes. Arrays and tensors are shipped as bytes through zero-copy
# views; each ring segment is cut into chunks so that reducing one chunk
# overlaps receiving the next. Messages below a crossover size take MPI's own
# non-blocking collective instead (mpicomm.native).

from __future__ import annotations

import zlib

import numpy as np
from mpi4py import MPI

from . import native as N
from . import validate as V
from .buffers import (OP_CODES, Buffer, BufferError, allreduce_operands, block_counts, check_op, chunk_ranges,
                      offsets, wrap)
from .handle import Handle
from .quiesce import quiesce
from .requests import RequestLog, drain_at_exit
from .ring_steps import ring_steps
from .scratch import SCRATCH
from .tags import TagAllocator, TagError, check_tag

IN_PLACE = MPI.IN_PLACE
DEFAULT_CHUNK_BYTES = 4 << 20  # measured best of 256K..16M for 4-64 MiB here (benchmarks/collectives.md)


class Ring:
    """Ring collectives over a private duplicate of `comm`.

    validate: exchange a fingerprint (kind, dtype, op, root, tag, length) first
    and raise CollectiveMismatchError on every rank when ranks disagree,
    instead of hanging or corrupting data. Defaults to $MPITRAIN_VALIDATE (on).
    chunk_bytes: pipelining granularity inside a ring step.
    latency_bytes: the crossover. A collective smaller than this (bytes as
    jobs.bench.collectives counts them: the buffer; reduce_scatter's input;
    allgather's output) is handed to MPI's non-blocking collective
    (Iallreduce, Ireduce_scatter, Iallgather, Ibcast) on a communicator of
    its own, still behind a Handle and still validated; allgatherv and
    float16/bfloat16 reductions always take the ring. An int for every kind,
    a {kind: bytes} dict, or None: $MPITRAIN_RING_LATENCY_BYTES (bytes such
    as '4M', or a JSON file from `jobs.bench.collectives --crossover`), else
    mpicomm.native.DEFAULT_LATENCY_BYTES (16 MiB for allreduce and broadcast,
    64 MiB for reduce_scatter and allgather, measured on the development VM).
    0 turns the latency path off. All ranks must agree (checked here).
    With validation, the path is chosen from the fingerprints all ranks
    exchanged, so ranks whose lengths straddle the crossover still fail
    together. Without it, a collective with an explicit tag always takes the
    ring: explicit tags let ranks start collectives in different orders
    (wfbp's buckets), which MPI's collectives do not allow.
    """

    def __init__(self, comm: MPI.Comm = MPI.COMM_WORLD, *, validate: bool | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, latency_bytes: int | dict | None = None):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        table, problem = None, None
        try:
            table = N.latency_table(latency_bytes)
        except ValueError as exc:
            problem = exc
        self.comm = drain_at_exit(comm.Dup())  # collective: keeps our traffic apart from the caller's
        try:
            N.agree_on_table(self.comm, table, problem)
        except Exception:
            self.comm.Free()
            raise
        self.latency_bytes: dict[str, int] = table
        self.native = N.Sequencer(self.comm)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.left = (self.rank - 1) % self.size
        self.right = (self.rank + 1) % self.size
        self.validate = V.default_validate() if validate is None else bool(validate)
        self.chunk_bytes = int(chunk_bytes)
        self.tags = TagAllocator(self.comm)

    # -- lifecycle ---------------------------------------------------------
    def free(self, drain: bool = True) -> None:
        """Collective, as MPI_Comm_free: what calls cancelled on one side left queued is dropped first
        (mpicomm.quiesce), not handed to MPI's next communicator; `drain=False` (an error path, where a peer may
        be gone) skips that."""
        if self.comm != MPI.COMM_NULL:
            if drain:
                quiesce([self.comm])
            self.native.free()
            self.comm.Free()

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.free(drain=exc_type is None)

    # -- public collectives ------------------------------------------------
    def allreduce(self, buf, out=None, *, op: str = "sum", tag: int | None = None) -> Handle:
        """Reduce `buf` across ranks into `out` (in place into `buf` when out is None)."""
        lean = N.lean_allreduce(self, buf, out, op, tag)
        if lean is not None:
            return lean
        log = RequestLog("ring allreduce")
        return Handle("allreduce", self._allreduce(buf, out, op, tag, log), log)

    def reduce_scatter(self, buf, out=None, *, op: str = "sum", tag: int | None = None) -> Handle:
        """Rank r gets block r of the reduction (blocks as in `block_counts`).

        In place (out None) the result is written into block r of `buf`, whose
        other blocks are left holding partial sums; the handle returns that
        block. Out of place, `buf` is left untouched.
        """
        log = RequestLog("ring reduce_scatter")
        return Handle("reduce_scatter", self._reduce_scatter(buf, out, op, tag, log), log)

    def allgather(self, buf, out=None, *, tag: int | None = None) -> Handle:
        """Concatenate every rank's `buf` (same length everywhere) into `out`.

        Pass buf=IN_PLACE when this rank's block already sits in `out`.
        """
        log = RequestLog("ring allgather")
        return Handle("allgather", self._allgather(buf, out, None, tag, "allgather", log), log)

    def allgatherv(self, buf, out=None, *, counts=None, tag: int | None = None) -> Handle:
        """Concatenate blocks of different lengths; `counts` is exchanged when not given."""
        log = RequestLog("ring allgatherv")
        return Handle("allgatherv", self._allgather(buf, out, counts, tag, "allgatherv", log), log)

    def broadcast(self, buf, root: int = 0, *, tag: int | None = None) -> Handle:
        """Copy root's `buf` into every rank's `buf`, pipelined along the ring."""
        log = RequestLog("ring broadcast")
        return Handle("broadcast", self._broadcast(buf, root, tag, log), log)

    # -- argument handling -------------------------------------------------
    def _tag(self, tag, problem):
        """(tag, problem): a bad explicit tag becomes a shared problem, not a local raise."""
        if tag is None:
            return self.tags.next(), problem
        try:
            return check_tag(self.comm, tag), problem
        except TagError as exc:
            return -1, problem or exc

    _wrap = staticmethod(wrap)  # (Buffer, None) or (None, error): the error is shared before it is raised

    def _agree(self, kind, problem, *, ref=None, op="sum", root=0, tag=0, count=None, extra=0,
               native=None, explicit=False, keep: tuple = ()):
        """Generator step shared by all collectives: every rank fails together or proceeds together.

        The rank with a local problem raises it; the others raise
        CollectiveMismatchError naming that rank, instead of waiting for it.
        native(): posts the latency path's MPI call (kinds that have one); it
        runs when the collective is below the crossover, and the step then
        returns its requests (None: take the ring). keep: its buffers, for abandon.
        """
        count = (ref.count if ref else 0) if count is None else count
        limit = self.latency_bytes.get(kind, 0) if native is not None and self.size > 1 else 0
        if not self.validate or self.size == 1:
            if problem:
                raise problem
            # Unvalidated, this rank's own values decide. Automatic tags mean the same start order
            # everywhere; an explicit one may not.
            if limit and not explicit and N.small(kind, ref.dtype, count * ref.itemsize, limit):
                return self.native.post(native)
            return None
        mine = V.fingerprint(kind, dtype=ref.dtype_code if ref else 0, op=OP_CODES.get(op, 0), root=root,
                             tag=tag, count=count, extra=extra, error=problem is not None)
        reqs = None
        if limit:
            table, reqs = yield from self.native.agree(self.comm, mine, kind, limit, native, keep)
        else:
            table = yield from V.exchange(self.comm, mine)
        if problem:
            raise type(problem)(f"{kind}: {problem}")
        V.check(kind, table)
        return reqs

    _check_op = staticmethod(check_op)

    # -- algorithms --------------------------------------------------------
    def _allreduce(self, buf, out, op, tag, log):
        src, dst, problem = allreduce_operands(buf, out, op)
        explicit = tag is not None
        tag, problem = self._tag(tag, problem)
        keep = (src, dst)  # the latency path's buffers: held until its requests end, or abandoned with them
        reqs = yield from self._agree("allreduce", problem, ref=src, op=op, tag=tag, explicit=explicit,
                                      native=lambda: N.iallreduce(self.native.comm, src, dst, op), keep=keep)
        if reqs is not None:
            yield from self.native.wait(reqs, keep=keep)
            return dst.obj
        if dst is not src:
            dst.copy_from(src)
        counts = block_counts(dst.count, self.size)
        yield from ring_steps(self, dst, counts, range(0, 2 * self.size - 2), op, tag, log)
        return dst.obj

    def _reduce_scatter(self, buf, out, op, tag, log):
        src, problem = self._wrap(buf, "buf")
        problem = problem or self._check_op(op)
        counts = block_counts(src.count if src else 0, self.size)
        lo = offsets(counts)[self.rank]
        hi = lo + counts[self.rank]
        dst = None
        if out is not None and problem is None:
            dst, problem = self._wrap(out, "out")
            if dst is not None and (dst.count != counts[self.rank] or dst.dtype != src.dtype):
                problem = BufferError(f"out has {dst.count} x {dst.dtype}, rank {self.rank} needs "
                                      f"{counts[self.rank]} x {src.dtype}")
        explicit = tag is not None
        tag, problem = self._tag(tag, problem)
        # In place, MPI would leave block r at the start of buf: it goes through scratch instead.
        target = [dst]
        keep = (src, target)
        reqs = yield from self._agree("reduce_scatter", problem, ref=src, op=op, tag=tag, explicit=explicit,
                                      native=lambda: N.ireduce_scatter(self.native.comm, src, target, counts, op),
                                      keep=keep)
        if reqs is not None:
            yield from self.native.wait(reqs, keep=keep)
            if dst is not None:
                return dst.obj
            src.copy_from(target[0], lo)
            SCRATCH.give(target[0])  # only here: an abandoned request may still write into it
            return src.elements(lo, hi)
        if dst is None:
            yield from ring_steps(self, src, counts, range(0, self.size - 1), op, tag, log)
            return src.elements(lo, hi)
        if self.size == 1:
            dst.copy_from(src)
        yield from ring_steps(self, src, counts, range(0, self.size - 1), op, tag, log, out=dst)
        return dst.obj

    def _allgather(self, buf, out, counts, tag, kind, log):
        in_place = buf is IN_PLACE
        src = dst = problem = None
        if not in_place:
            src, problem = self._wrap(buf, "buf")
        elif out is None:
            problem = ValueError("buf=IN_PLACE needs an out buffer")
        if out is not None and problem is None:
            dst, problem = self._wrap(out, "out")
        explicit = tag is not None
        tag, problem = self._tag(tag, problem)
        if kind == "allgather":
            local = src.count if src else (dst.count // self.size if dst else 0)
            if problem is None and in_place and dst.count % self.size:
                problem = BufferError(f"out has {dst.count} elements, not a multiple of {self.size} ranks")
            counts = [local] * self.size
        elif counts is None:
            if in_place and problem is None:
                problem = ValueError("allgatherv with buf=IN_PLACE needs counts")
            counts = yield from self._exchange_counts(src.count if src and not problem else -1, problem)
        else:
            counts = [int(c) for c in counts]
            if problem is None and (len(counts) != self.size or min(counts) < 0):
                problem = ValueError(f"counts must list {self.size} non-negative lengths, got {counts}")
            elif problem is None and src is not None and counts[self.rank] != src.count:
                problem = BufferError(f"counts[{self.rank}]={counts[self.rank]} but buf has {src.count} elements")
        total = sum(counts) if problem is None else 0
        if problem is None and dst is not None and (dst.count != total or (src and dst.dtype != src.dtype)):
            problem = BufferError(f"out has {dst.count} x {dst.dtype}, needs {total} x {(src or dst).dtype}")
        ref = src or dst
        target = [dst]  # the latency path allocates out when none was given
        keep = (src, target)
        reqs = yield from self._agree(kind, problem, ref=ref, tag=tag, count=total,
                                      extra=zlib.crc32(np.asarray(counts, dtype=np.int64).tobytes()),
                                      native=(lambda: N.iallgather(self.native.comm, src, target, total))
                                      if kind == "allgather" else None, explicit=explicit, keep=keep)
        if reqs is not None:
            yield from self.native.wait(reqs, keep=keep)
            return target[0].obj
        if dst is None:
            dst = src.scratch(total)
        offs = offsets(counts)
        if src is not None:
            dst.copy_from(src, offs[self.rank])
        yield from ring_steps(self, dst, counts, range(self.size - 1, 2 * self.size - 2), None, tag, log)
        return dst.obj

    def _exchange_counts(self, local: int, problem):
        """Generator step: every rank's block length (-1 flags a rank with a local problem), in a fingerprint's
        row: a rank given counts sends its fingerprint in the same collective, and is named (V.COUNTS)."""
        table = yield from V.exchange(self.comm, V.fingerprint(V.COUNTS, count=local))
        V.check_kinds(table)
        lengths = table[:, V.FIELDS.index("count")]
        bad = np.flatnonzero(lengths < 0).tolist()
        if problem:
            raise type(problem)(f"allgatherv: {problem}")
        if bad:
            raise V.CollectiveMismatchError(f"allgatherv: rank(s) {bad} passed an invalid argument")
        return lengths.tolist()

    def _broadcast(self, buf, root, tag, log):
        b, problem = self._wrap(buf, "buf")
        if problem is None and not (isinstance(root, int) and 0 <= root < self.size):
            problem = ValueError(f"root {root!r} outside [0, {self.size})")
        explicit, (tag, problem) = tag is not None, self._tag(tag, problem)
        root_or_bad = root if problem is None else -1
        reqs = yield from self._agree("broadcast", problem, ref=b, root=root_or_bad, tag=tag, keep=(b,),
                                      explicit=explicit, native=lambda: [self.native.comm.Ibcast(N.raw(b), root)])
        if reqs is not None:
            yield from self.native.wait(reqs, keep=(b,))
            return b.obj
        if self.size == 1 or b.count == 0:
            return b.obj
        # Chain root -> root+1 -> ...: each rank forwards a chunk as soon as it has it.
        last = (root - 1) % self.size
        chunks = chunk_ranges(0, b.count, self._chunk_elems(b))
        sends = []
        if self.rank == root:
            sends = [log.isend(self.comm, [b.bytes(a, z), MPI.BYTE], self.right, tag) for a, z in chunks]
        else:
            recvs = [log.irecv(self.comm, [b.bytes(a, z), MPI.BYTE], self.left, tag) for a, z in chunks]
            for req, (a, z) in zip(recvs, chunks):
                yield [req]
                if self.rank != last:
                    sends.append(log.isend(self.comm, [b.bytes(a, z), MPI.BYTE], self.right, tag))
        yield sends
        return b.obj

    def _chunk_elems(self, b: Buffer) -> int:
        return max(1, self.chunk_bytes // b.itemsize)
