"""The Ring's latency path: MPI's own non-blocking collectives for messages below a crossover size."""

from __future__ import annotations

import collections
import json
import os
import threading

import numpy as np
from mpi4py import MPI

from . import validate as V
from .buffers import DTYPE_CODES, OP_CODES, Buffer, is_torch
from .handle import Handle, Step
from .requests import abandon
from .scratch import SCRATCH
from .tags import TagError, check_tag
from .validate import FIELDS, CollectiveMismatchError, agreed

# Reductions need an MPI datatype; float16 and bfloat16 have no standard one, so they stay on the ring.
MPI_TYPES = {"float32": MPI.FLOAT, "float64": MPI.DOUBLE, "int8": MPI.INT8_T, "int16": MPI.INT16_T,
             "int32": MPI.INT32_T, "int64": MPI.INT64_T, "uint8": MPI.UINT8_T}
MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}
KINDS = ("allreduce", "reduce_scatter", "allgather", "broadcast")
REDUCING = ("allreduce", "reduce_scatter")
ITEMSIZE = {code: (2 if name == "bfloat16" else np.dtype(name).itemsize) for name, code in DTYPE_CODES.items()}
NATIVE_CODES = {DTYPE_CODES[name] for name in MPI_TYPES}

# Below this many bytes (as jobs.bench.collectives counts them: the buffer, reduce-scatter's input,
# allgather's output) a collective takes the latency path. On the 2-vCPU VM the ring overtakes
# MPICH from 16 MiB for allreduce and broadcast, from 64 MiB or more for reduce-scatter and
# allgather (benchmarks/collectives.md). Erring high is cheap: near the crossover both are about as fast.
# `jobs.bench.collectives --crossover PATH` measures a machine's own.
DEFAULT_LATENCY_BYTES = {"allreduce": 16 << 20, "reduce_scatter": 64 << 20, "allgather": 64 << 20,
                         "broadcast": 16 << 20}
ENV = "MPITRAIN_RING_LATENCY_BYTES"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """'0', '4096', '64K', '16M', '1G' (binary units) -> bytes; ValueError otherwise."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = int(float(t[: len(t) - len(unit)]) * _UNITS[unit])
    except (ValueError, OverflowError):
        raise ValueError(f"not a byte count: {text!r} (examples: 0, 64K, 16M)") from None
    if value < 0:
        raise ValueError(f"byte count must be >= 0, got {text!r}")
    return value


def latency_table(value) -> dict[str, int]:
    """Crossover bytes per kind from an int (every kind), a {kind: bytes} dict (others: the defaults) or None.

    None reads $MPITRAIN_RING_LATENCY_BYTES: a byte count ('0' turns the
    latency path off, '4M') or the path of a JSON file written by
    `jobs.bench.collectives --crossover` (its "latency_bytes" object).
    """
    if value is None:
        text = os.environ.get(ENV, "").strip()
        if not text:
            return dict(DEFAULT_LATENCY_BYTES)
        if not os.path.exists(text):
            try:
                return dict.fromkeys(KINDS, parse_bytes(text))
            except ValueError:
                raise ValueError(f"${ENV}={text!r}: neither a byte count (0, 64K, 16M) nor an existing "
                                 "crossover JSON file") from None
        try:
            with open(text) as f:
                value = json.load(f)["latency_bytes"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"${ENV}={text!r}: not a crossover JSON file with a 'latency_bytes' object "
                             f"({type(exc).__name__}: {exc})") from None
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"latency_bytes: unknown collective(s) {unknown} (use {', '.join(KINDS)})")
        table = dict(DEFAULT_LATENCY_BYTES)
        table.update(value)
    else:
        table = dict.fromkeys(KINDS, value)
    for kind, v in table.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"latency_bytes[{kind!r}] must be an int >= 0, got {v!r}")
    return {k: int(v) for k, v in table.items()}


def agree_on_table(comm: MPI.Comm, table: dict[str, int] | None, problem: Exception | None) -> None:
    """Raise on every rank unless all ranks hold the same crossover table (one small Allgather).

    Ranks with different crossovers would pick different paths for one collective.
    """
    mine = np.array([table[k] for k in KINDS] if problem is None else [-1] * len(KINDS), dtype=np.int64)
    every = np.empty((comm.Get_size(), len(KINDS)), dtype=np.int64)
    comm.Allgather(mine, every)
    if problem is not None:
        raise problem
    bad = np.flatnonzero(every[:, 0] < 0).tolist()
    if bad:
        raise CollectiveMismatchError(f"Ring: rank(s) {bad} have an invalid latency_bytes / ${ENV}")
    for i, kind in enumerate(KINDS):
        column = every[:, i]
        if np.any(column != column[0]):
            values = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(column))
            raise CollectiveMismatchError(f"Ring: ranks disagree on latency_bytes for {kind} ({values}); "
                                          f"set {ENV} or latency_bytes alike on every rank")


def small(kind: str, dtype: str, nbytes: int, limit: int) -> bool:
    """Whether a collective of `kind` over `nbytes` of `dtype` takes the latency path."""
    return nbytes < limit and (kind not in REDUCING or dtype in MPI_TYPES)


def below(table: np.ndarray, kind: str, limit: int) -> bool:
    """Whether a fingerprint table agreed on by every rank sends `kind` down the latency path.

    False when the ranks disagree or one failed: the ring's checks raise then.
    """
    if not agreed(table):
        return False
    name = _DTYPE_NAMES.get(int(table[0, _DTYPE]))
    return name is not None and small(kind, name, int(table[0, _COUNT]) * ITEMSIZE[DTYPE_CODES[name]], limit)


_DTYPE, _COUNT = FIELDS.index("dtype"), FIELDS.index("count")
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


# -- posting: zero-copy views of the Ring's Buffers ------------------------------------------
def typed(b: Buffer):
    """b's memory as its MPI element type (reductions need it)."""
    return [b.bytes(), b.count, MPI_TYPES[b.dtype]]


def raw(b: Buffer):
    """b's memory as bytes (collectives that only move data: any dtype, bfloat16 included)."""
    return [b.bytes(), MPI.BYTE]


def iallreduce(comm: MPI.Comm, src: Buffer, dst: Buffer, op: str) -> list:
    if dst is not src and np.may_share_memory(src.bytes(), dst.bytes()):
        dst.copy_from(src)  # MPI refuses aliased buffers (out=buf): reduce in place instead
        src = dst
    if dst is src:
        return [comm.Iallreduce(MPI.IN_PLACE, typed(dst), MPI_OPS[op])]
    return [comm.Iallreduce(typed(src), typed(dst), MPI_OPS[op])]


def ireduce_scatter(comm: MPI.Comm, src: Buffer, target: list, counts: list, op: str) -> list:
    """Block r into target[0]: a scratch buffer is put there when it is None (SCRATCH's: its caller gives it back
    once the request has completed and the block is copied out)."""
    if target[0] is None:
        target[0] = SCRATCH.take(src, counts[comm.Get_rank()])
    return [comm.Ireduce_scatter(typed(src), typed(target[0]), counts, MPI_OPS[op])]


def iallgather(comm: MPI.Comm, src: Buffer | None, target: list, total: int) -> list:
    """Into target[0] (allocated when None); src None: this rank's block already sits there."""
    if target[0] is None:
        target[0] = src.scratch(total)
    return [comm.Iallgather(MPI.IN_PLACE if src is None else raw(src), raw(target[0]))]


# -- allreduce's lean path ----------------------------------------------------------------------
# What decides 4 KiB is Python work per call: for the common case (a contiguous numpy array or
# CPU tensor of a type MPI reduces, below the crossover) allreduce skips the ring's Buffer
# objects, request log and generator layers. It posts the same fingerprint as the general path,
# and the same verdict follows from the same table: ranks may take either code path.
_MPI_BY_DTYPE = {np.dtype(name): t for name, t in MPI_TYPES.items()}
_CODE_BY_DTYPE = {np.dtype(name): DTYPE_CODES[name] for name in MPI_TYPES}
_ALLREDUCE = V.KINDS["allreduce"]


def array_of(obj):
    """A writeable C-contiguous numpy view of obj's memory, if MPI reduces its dtype; else None."""
    if type(obj) is not np.ndarray:
        if not is_torch(obj) or obj.device.type != "cpu":
            return None
        try:
            obj = obj.detach().numpy()  # shares memory; refuses bfloat16 and conjugate views
        except (TypeError, RuntimeError):
            return None
    flags = obj.flags
    return obj if flags.c_contiguous and flags.writeable and obj.dtype in _MPI_BY_DTYPE else None


def lean_allreduce(ring, buf, out, op: str, tag) -> Handle | None:
    """Ring.allreduce's latency path for the common case, or None: the general path decides."""
    limit = ring.latency_bytes["allreduce"]
    a = array_of(buf)
    if a is None or a.nbytes >= limit or op not in MPI_OPS or ring.size == 1 or (tag is not None and not ring.validate):
        return None
    o = a
    if out is not None:
        o = array_of(out)
        if o is None or o.dtype != a.dtype or o.size != a.size:
            return None
        if o is not a and np.may_share_memory(a, o):
            return None  # aliased: the general path reduces in place
    if tag is None:
        tag = ring.tags.next()
    else:
        try:
            tag = check_tag(ring.comm, tag)
        except TagError:
            return None  # the general path shares the error with the other ranks
    seq, mtype, mop = ring.native, _MPI_BY_DTYPE[a.dtype], MPI_OPS[op]
    if o is a:
        def post():
            return [seq.comm.Iallreduce(MPI.IN_PLACE, [a, mtype], mop)]
    else:
        def post():
            return [seq.comm.Iallreduce([a, mtype], [o, mtype], mop)]
    result = buf if out is None else out
    if not ring.validate:
        return Handle("allreduce", seq.wait(seq.post(post), result, keep=(a, o)))
    mine = np.array((_ALLREDUCE, _CODE_BY_DTYPE[a.dtype], OP_CODES[op], 0, tag, a.size, 0, 0), dtype=np.int64)
    table = np.empty((ring.size, mine.size), dtype=np.int64)
    # This rank is below the crossover, so "every rank sent my fingerprint" is below()'s verdict.
    expect = mine.tobytes() * ring.size
    entry = seq.add(ring.comm, mine, table, lambda t: post() if t.tobytes() == expect else None, keep=(a, o))
    return Handle("allreduce", seq.settled(entry, result))


class Pending(Step):
    """A validated collective whose fingerprints are in flight; settled in start order by its Sequencer."""

    __slots__ = ("seq", "req", "table", "decide", "keep", "reqs", "settled", "abandoned")

    def __init__(self, seq: "Sequencer", req, table, decide, keep: tuple):
        self.seq, self.req, self.table, self.decide = seq, req, table, decide
        self.keep = keep  # the fingerprints' arrays and the native call's buffers, for requests.abandon
        self.reqs, self.settled, self.abandoned = None, False, False

    def poll(self, block: bool) -> bool:
        return self.settled or self.seq.settle(self, block)


class Sequencer:
    """Posts the latency path's native collectives, on a communicator of their own, in start order.

    MPI matches non-blocking collectives by the order ranks start them. A
    validated collective can only pick its path once the fingerprints are in,
    and handles are driven in any order (wait B, then A): so the native call
    is posted when the collective is *settled*, and collectives are settled
    strictly in start order, whichever handle is being driven. Every rank
    settles the same sequence with the same tables, so every rank posts the
    same native calls in the same order. The fingerprint requests are only
    touched under the lock: a handle waiting on an earlier collective's
    fingerprints may run on another thread than that collective's handle.
    """

    def __init__(self, comm: MPI.Comm):
        self.comm = comm.Dup()
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.posted = 0  # collectives that took the latency path (tests and benchmarks read it)

    def post(self, native):
        """An unvalidated latency-path call, posted at once (the caller's start order is the order)."""
        self.posted += 1
        return native()

    def add(self, comm: MPI.Comm, mine: np.ndarray, table: np.ndarray, decide, keep: tuple) -> Pending:
        """Start a validated collective: gather fingerprints into `table`; decide(table) -> requests or None.
        keep: what the native call decide() may post reads and writes (its buffers), for an abandoned one."""
        with self._lock:  # the queue's order is the order the fingerprints were posted
            entry = Pending(self, comm.Iallgather(mine, table), table, decide, (mine, table, *keep))
            self._queue.append(entry)
        return entry

    def settle(self, entry: Pending, block: bool) -> bool:
        """Settle collectives in start order up to `entry`; without block, only those already complete."""
        if not self._lock.acquire(blocking=block):
            return False  # another thread is settling: poll again later
        try:
            queue = self._queue
            while queue and not entry.settled:
                head = queue[0]
                if head.req:  # still in flight (a completed request is MPI.REQUEST_NULL)
                    if block:
                        head.req.Wait()
                    elif not head.req.Test():
                        break
                queue.popleft()
                try:
                    head.reqs = head.decide(head.table)
                finally:
                    head.settled = True  # after reqs: a handle on another thread reads it without the lock
                self.posted += head.reqs is not None
                if head.abandoned:
                    _orphan(head.reqs, head.keep)
        finally:
            self._lock.release()
        return entry.settled

    def agree(self, comm: MPI.Comm, mine: np.ndarray, kind: str, limit: int, native, keep: tuple):
        """Generator step: exchange fingerprints on `comm`; (table, native()'s requests or None).

        native() runs, in start order, when every rank named the same
        collective below `limit` bytes.
        """
        table = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
        entry = self.add(comm, mine, table, lambda t: native() if below(t, kind, limit) else None, keep)
        try:
            yield entry
        except GeneratorExit:  # cancelled: other ranks may still post the native call
            self.abandon(entry)
            raise
        return table, entry.reqs

    def wait(self, reqs: list, result=None, *, keep: tuple):
        """Generator step: the native call's requests, then `result`; cancelled, it completes in the background,
        `keep` (its buffers) held until then."""
        try:
            yield reqs
        except GeneratorExit:
            self.abandon(None, reqs, keep)
            raise
        return result

    def settled(self, entry: Pending, result):
        """Generator: the lean path's whole algorithm, once its fingerprints went out."""
        try:
            yield entry
        except GeneratorExit:
            self.abandon(entry)
            raise
        reqs = entry.reqs
        if reqs is None:  # this rank was below the crossover: only a disagreement stops the native call
            V.check("allreduce", entry.table)
            raise AssertionError("agreed fingerprints but no latency path")  # pragma: no cover
        return (yield from self.wait(reqs, result, keep=entry.keep))

    def abandon(self, entry: Pending | None, reqs=None, keep: tuple = ()) -> None:
        """A handle was cancelled: its native call is still posted when settled, and completed in the background."""
        with self._lock:
            if entry is not None:
                entry.abandoned = True
                if entry.settled:
                    _orphan(entry.reqs, entry.keep)
            _orphan(reqs, keep)

    def free(self) -> None:
        with self._lock:  # collectives started, never settled (their handles were dropped): fingerprints only
            for entry in self._queue:
                abandon(entry.req, "ring latency path: fingerprints", keep=entry.keep)
            self._queue.clear()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def _orphan(reqs, keep: tuple) -> None:
    """MPI cannot withdraw a native collective that other ranks may have posted: it completes in the background."""
    for r in reqs or ():
        abandon(r, "ring latency path", keep=keep)
