"""mpicomm: everything in mpitrain that talks MPI (topology, ring collectives, tags, validation)."""

from . import shutdown  # noqa: F401 - registers the exit step that runs before MPI_Finalize
from .buffers import BufferError, block_counts
from .collectives import Collectives
from .handle import Handle, wait_all
from .ring import IN_PLACE, Ring
from .tags import TagAllocator, TagError, check_tag, slice_tag
from .topology import Topology, TopologyError
from .validate import CollectiveMismatchError

__all__ = [
    "BufferError", "CollectiveMismatchError", "Collectives", "Handle", "IN_PLACE", "Ring", "TagAllocator", "TagError",
    "Topology", "TopologyError", "block_counts", "check_tag", "slice_tag", "wait_all",
]
