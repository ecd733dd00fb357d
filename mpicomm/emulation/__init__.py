"""A cluster on one machine: hosts in network namespaces joined by shaped links, MPI across them."""

from .cluster import EmulatedCluster, read_state, run_local
from .netns import EmulationError, format_bandwidth, parse_bandwidth

__all__ = ["EmulatedCluster", "EmulationError", "format_bandwidth", "parse_bandwidth", "read_state", "run_local"]
