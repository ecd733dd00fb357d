"""Start-up agreement between ranks: identical model structure, then rank 0's values everywhere."""

from __future__ import annotations

import zlib

import numpy as np
from mpi4py import MPI

from .handle import wait_all
from .ring import Ring
from .validate import CollectiveMismatchError


def check_same_structure(comm: MPI.Comm, entries: list[str], what: str = "parameter") -> None:
    """Raise on every rank unless all ranks hold the same list of descriptions (e.g. 'fc1.weight (256, 784) float32').

    One small Allgather of a checksum in the common case; only on a mismatch
    are the lists gathered to name the first entry that differs.
    """
    digest = np.array([len(entries), zlib.crc32("\n".join(entries).encode())], dtype=np.int64)
    table = np.empty((comm.Get_size(), 2), dtype=np.int64)
    comm.Allgather(digest, table)
    if np.all(table == table[0]):
        return
    lists = comm.allgather(entries)  # rare path and start-up only: pickling is fine
    for i in range(max(len(x) for x in lists)):
        column = [x[i] if i < len(x) else "(missing)" for x in lists]
        if any(c != column[0] for c in column):
            shown = "; ".join(f"rank {r}: {c}" for r, c in enumerate(column))
            raise CollectiveMismatchError(f"models differ across ranks at {what} #{i}: {shown}")
    raise CollectiveMismatchError(f"models differ across ranks ({what} lists of different lengths)")


def fail_together(comm: MPI.Comm, problem: str | None, error: type[Exception] = RuntimeError) -> None:
    """Raise on every rank if any rank has a problem, each naming all of them; else return.

    One int8 Allgather when all is well, so it can guard every step: a rank
    that raised alone would leave the others waiting in the next collective.
    """
    flags = np.empty(comm.Get_size(), dtype=np.int8)
    comm.Allgather(np.array([problem is not None], dtype=np.int8), flags)
    if not flags.any():
        return
    problems = comm.allgather(problem)  # failure path only: pickling is fine
    raise error("; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None))


def broadcast_tensors(comm: MPI.Comm, tensors, root: int = 0) -> None:
    """Overwrite every rank's tensors with root's, all in flight together."""
    with Ring(comm) as ring:
        wait_all([ring.broadcast(t, root=root) for t in tensors if t.numel()])
