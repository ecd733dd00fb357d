"""Cross-rank agreement checks: a small integer fingerprint exchanged before a collective moves data."""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from .buffers import DTYPE_CODES, OP_CODES

# COUNTS: allgatherv's exchange of block lengths, where its caller gave none; a row of its own kind, in the same
# collective as a validated call's fingerprints, so that ranks that differ on passing counts are told apart.
COUNTS = "allgatherv, no counts"
KINDS = {"allreduce": 1, "reduce_scatter": 2, "allgather": 3, "allgatherv": 4, "broadcast": 5, COUNTS: 6}
FIELDS = ("kind", "dtype", "op", "root", "tag", "count", "extra", "error")
MUST_MATCH = ("kind", "dtype", "op", "root", "tag", "count", "extra")
_NAMES = {
    "kind": {v: k for k, v in KINDS.items()},
    "dtype": {v: k for k, v in DTYPE_CODES.items()},
    "op": {v: k for k, v in OP_CODES.items()},
}


class CollectiveMismatchError(RuntimeError):
    """Ranks started a collective with arguments that do not agree; raised on every rank."""


def default_validate() -> bool:
    """Validation is on unless MPITRAIN_VALIDATE is 0/false/no/off."""
    return os.environ.get("MPITRAIN_VALIDATE", "1").strip().lower() not in ("0", "false", "no", "off")


def fingerprint(kind: str, dtype: int = 0, op: int = 0, root: int = 0, tag: int = 0,
                count: int = 0, extra: int = 0, error: bool = False) -> np.ndarray:
    """`extra` is a kind-specific check value, e.g. a checksum of allgatherv's counts."""
    return np.array([KINDS[kind], dtype, op, root, tag, count, extra, int(error)], dtype=np.int64)


def exchange(comm: MPI.Comm, mine: np.ndarray):
    """Generator step: gather every rank's fingerprint; returns a (size, len(FIELDS)) table."""
    table = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    yield [comm.Iallgather(mine, table)]
    return table


def _show(field: str, value: int) -> str:
    return _NAMES.get(field, {}).get(int(value), str(int(value)))


def _describe(field: str, column: np.ndarray) -> str:
    return ", ".join(f"rank {r}: {_show(field, v)}" for r, v in enumerate(column))


def agreed(table: np.ndarray) -> bool:
    """Every rank sent the same fingerprint, without an error flag."""
    # Compared as bytes: numpy's any()/all() dispatch costs ~10x more on a table this small.
    first = table[0].tobytes()
    return not table[0, -1] and table.tobytes() == first * table.shape[0]


def check(name: str, table: np.ndarray) -> None:
    """Raise the same CollectiveMismatchError on every rank if the fingerprints disagree.

    Every rank holds the identical table, so every rank reaches the same verdict:
    none is left waiting inside a ring for a partner that already gave up.
    """
    if agreed(table):
        return  # the common case
    errors = np.flatnonzero(table[:, FIELDS.index("error")])
    if errors.size:
        raise CollectiveMismatchError(f"{name}: rank(s) {errors.tolist()} passed an invalid argument")
    check_kinds(table)
    for field in MUST_MATCH:
        column = table[:, FIELDS.index(field)]
        if np.any(column != column[0]):
            what = {"count": "length", "extra": "block lengths"}.get(field, field)
            raise CollectiveMismatchError(f"{name}: ranks disagree on {what} ({_describe(field, column)})")


def check_kinds(table: np.ndarray) -> None:
    """Raise the same CollectiveMismatchError on every rank if the rows are of different kinds."""
    column = table[:, 0]
    if not np.any(column != column[0]):
        return
    if set(column.tolist()) == {KINDS["allgatherv"], KINDS[COUNTS]}:
        raise CollectiveMismatchError("allgatherv: every rank passes counts or none does "
                                      f"({_describe('kind', column)})")
    raise CollectiveMismatchError(f"ranks called different collectives ({_describe('kind', column)})")
