"""Message tags in two namespaces: explicit ones in the lower half of TAG_UB, automatic ones above."""

from __future__ import annotations

from mpi4py import MPI


class TagError(ValueError):
    """A tag outside the range its namespace allows on this communicator."""


def tag_upper_bound(comm: MPI.Comm) -> int:
    ub = comm.Get_attr(MPI.TAG_UB)
    # The standard guarantees at least 32767; some bindings report None on derived comms.
    return int(ub) if ub is not None else 32767


def end_tag(comm: MPI.Comm) -> int:
    """The top tag, which no call of this library sends: mpicomm.quiesce's end markers."""
    return tag_upper_bound(comm)


def explicit_tag_bound(comm: MPI.Comm) -> int:
    """The largest tag a caller may choose; tags above it are handed out automatically.

    Two namespaces on one communicator: a collective started with an explicit
    tag and one tagged automatically can never receive each other's messages.
    """
    return tag_upper_bound(comm) // 2


def check_tag(comm: MPI.Comm, tag: int) -> int:
    """An explicit tag: an int in [0, explicit_tag_bound(comm)]."""
    top = explicit_tag_bound(comm)
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= top:
        raise TagError(f"tag {tag!r} is outside [0, {top}]: explicit tags use the lower half of "
                       f"TAG_UB={tag_upper_bound(comm)}, the upper half is for automatic tags")
    return tag


class TagAllocator:
    """Hands out automatic tags, above the explicit namespace, in the order collectives are started.

    Collectives must be started in the same order on every rank (MPI's rule
    for non-blocking collectives too), so a counter gives matching tags
    everywhere without any communication.
    """

    def __init__(self, comm: MPI.Comm):
        self.ub = tag_upper_bound(comm)
        self.first = explicit_tag_bound(comm) + 1
        self._next = self.first

    def next(self) -> int:
        tag = self._next
        # Wrapping is safe: two collectives that far apart in the sequence are
        # never in flight together. The top tag is left to end markers (end_tag).
        self._next = self.first if tag >= self.ub - 1 else tag + 1
        return tag


def slice_tag(comm: MPI.Comm, tensor_index: int, slice_index: int, slices_per_tensor: int) -> int:
    """A distinct explicit tag per (tensor, slice), checked rather than silently wrapped."""
    if not 0 <= slice_index < slices_per_tensor:
        raise TagError(f"slice {slice_index} outside [0, {slices_per_tensor}) for tensor {tensor_index}")
    return check_tag(comm, tensor_index * slices_per_tensor + slice_index)
