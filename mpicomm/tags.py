"""Message tags: explicit ones checked against the communicator's TAG_UB, automatic ones allocated in call order."""

from __future__ import annotations

from mpi4py import MPI


class TagError(ValueError):
    """A tag outside [0, TAG_UB] of the communicator."""


def tag_upper_bound(comm: MPI.Comm) -> int:
    ub = comm.Get_attr(MPI.TAG_UB)
    # The standard guarantees at least 32767; some bindings report None on derived comms.
    return int(ub) if ub is not None else 32767


def check_tag(comm: MPI.Comm, tag: int) -> int:
    ub = tag_upper_bound(comm)
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= ub:
        raise TagError(f"tag {tag!r} is outside [0, TAG_UB={ub}] of this communicator")
    return tag


class TagAllocator:
    """Hands out tags for collectives in the order they are started.

    Collectives must be started in the same order on every rank (MPI's rule
    for non-blocking collectives too), so a counter gives matching tags
    everywhere without any communication. Tags below `reserved` are left for
    callers that key tags themselves, e.g. by (tensor, slice).
    """

    def __init__(self, comm: MPI.Comm, reserved: int = 0):
        self.ub = tag_upper_bound(comm)
        if not 0 <= reserved < self.ub:
            raise TagError(f"reserved={reserved} leaves no automatic tags below TAG_UB={self.ub}")
        self.first = reserved
        self._next = reserved

    def next(self) -> int:
        tag = self._next
        # Wrapping is safe: two collectives that far apart in the sequence are
        # never in flight together.
        self._next = self.first if tag >= self.ub else tag + 1
        return tag


def slice_tag(comm: MPI.Comm, tensor_index: int, slice_index: int, slices_per_tensor: int) -> int:
    """A distinct tag per (tensor, slice), checked against TAG_UB rather than silently wrapped."""
    if not 0 <= slice_index < slices_per_tensor:
        raise TagError(f"slice {slice_index} outside [0, {slices_per_tensor}) for tensor {tensor_index}")
    return check_tag(comm, tensor_index * slices_per_tensor + slice_index)
