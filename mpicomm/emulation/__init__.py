"""A cluster on one machine: hosts in network namespaces joined by shaped links, MPI across them."""

from .cluster import EmulatedCluster, eager_send_buffer, read_state, run_local, tcp_wmem_max
from .netns import EmulationError, format_bandwidth, link_burst, parse_bandwidth

__all__ = ["EmulatedCluster", "EmulationError", "eager_send_buffer", "format_bandwidth", "link_burst",
           "parse_bandwidth", "read_state", "run_local", "tcp_wmem_max"]
