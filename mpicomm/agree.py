"""Start-up agreement between ranks: identical model structure, then rank 0's values everywhere."""

from __future__ import annotations

import zlib

import numpy as np
from mpi4py import MPI

from .validate import CollectiveMismatchError

DIRECT_BYTES = 1 << 18  # broadcast_tensors: tensors this large move in place, smaller ones packed


def check_same_structure(comm: MPI.Comm, entries: list[str], what: str = "parameter") -> None:
    """Raise on every rank unless all ranks hold the same list of descriptions (e.g. 'fc1.weight (256, 784) float32').

    The error names the first differing entry and which ranks hold which value.

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
            raise CollectiveMismatchError(f"ranks differ at {what} #{i}: {group_by_value(column)}")
    raise CollectiveMismatchError(f"ranks differ ({what} lists of different lengths)")


def group_by_value(values: list[str]) -> str:
    """'rank 0, 2: x; rank 1: y': each distinct value once, after the ranks that hold it."""
    order: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        order.setdefault(v, []).append(r)
    return "; ".join(f"rank {', '.join(map(str, rs))}: {v}" for v, rs in order.items())


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
    by_problem: dict[str, list[int]] = {}
    for r, p in enumerate(problems):
        if p is not None:
            by_problem.setdefault(p, []).append(r)
    # The same problem on many ranks is said once, after the ranks that have it.
    raise error("; ".join(f"rank {', '.join(map(str, rs))}: {p}" for p, rs in by_problem.items()))


def broadcast_tensors(comm: MPI.Comm, tensors, root: int = 0) -> None:
    """Overwrite every rank's tensors (any layout) with root's, with native non-blocking broadcasts.

    Start-up only, so simplicity wins over overlap with compute. Large tensors
    go in place (through a contiguous copy if their layout is not the
    default), each its own Ibcast, all in flight at once: packing them would
    copy the whole model twice. A tensor on a GPU moves through a host copy
    (start-up only: no pinned staging needed here). The small ones are packed into one buffer
    per dtype (a call per small tensor, each validated, took seconds on small
    models). Which tensors go which way depends only on their sizes, which
    the ranks have agreed on, never on a rank's memory layout.
    """
    import torch

    if comm.Get_size() == 1:
        return  # nothing to move
    mine = comm.Get_rank() == root
    direct, by_dtype = [], {}  # direct: (tensor, the buffer MPI fills)
    for t in tensors:
        if not t.numel():
            continue
        if t.numel() * t.element_size() >= DIRECT_BYTES:
            on_host = t.device.type == "cpu"
            direct.append((t, t.detach() if on_host and t.is_contiguous() else t.detach().cpu().contiguous()))
        else:
            by_dtype.setdefault(t.dtype, []).append(t)
    packed = [(group, torch.cat([t.detach().reshape(-1).cpu() for t in group]) if mine else
               torch.empty(sum(t.numel() for t in group), dtype=dtype)) for dtype, group in by_dtype.items()]
    with torch.no_grad():
        requests = [comm.Ibcast([buf.view(-1).view(torch.uint8).numpy(), MPI.BYTE], root=root)
                    for buf in [b for _, b in direct] + [flat for _, flat in packed]]
        MPI.Request.Waitall(requests)
        if not mine:
            for t, buf in direct:
                if buf.data_ptr() != t.data_ptr():
                    t.copy_(buf)
            for group, flat in packed:
                for t, part in zip(group, flat.split([t.numel() for t in group])):
                    t.copy_(part.view(t.shape))
