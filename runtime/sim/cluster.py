"""The simulated cluster: nodes, ranks per node, links, cores; and one representative host's resources."""

# Data-parallel training is symmetric: every host runs the same schedule on the
# same bytes at the same time, so one host stands for all of them. Its links
# carry its share of each collective (a ring crosses a host's network link once
# per step, whatever the ranks per node), its cores carry its ranks' compute and
# message copies. Only the pipeline, whose stages differ, simulates several
# (one per stage; runtime.sim.pipeline).

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .engine import Activity, Engine, Pool, Resource


class ClusterError(ValueError):
    """A cluster description that cannot be simulated."""


@dataclass(frozen=True)
class Cluster:
    """What the simulation is told about the machines (rates in bit/s, times in seconds).

    bandwidth: each host's network link, each direction. latency: one message's
    fixed cost end to end (wire, switch, MPI's and the transport's per-message
    work). intra_bandwidth: between two ranks of one node. oversubscription:
    the inter-node switch carries bandwidth x nodes / oversubscription when every
    host sends at once. efficiency: the share of the line rate that payload gets
    (headers, acknowledgements). transport_rate: the most one connection moves
    whatever the link (copies in MPI and the kernel; inf: no such limit).
    cpu_per_byte: core-seconds for a byte sent and one received (both ends'
    copies). send_buffer: bytes one connection takes before a send of it
    completes (an eager transport's socket buffer: p3_owners' credit frees
    then; 0: a send completes when it is delivered, as rendezvous does).
    burst: bytes a host's link lets through at once after an idle moment (an
    emulated link's token bucket, tc tbf's; 0: a NIC, every byte at the rate):
    the pipeline's sparse messages cross faster than the rate by that much.
    comm_cores: what a rank's progress thread takes of the cores for
    as long as its exchange is pending, beyond the copies (polling, its
    Python; measured per strategy on machines whose cores are shared); a
    thread that drives (wfbp's where compute is off the host) takes them only
    while the training thread waits for the exchange.
    cores_per_host: cores for compute and message copies; with
    shared_cores the hosts are emulated on one machine of that many cores and
    share them. device: "cpu" (compute takes the cores) or "gpu" (compute on
    one GPU per rank; the cores only copy messages).
    """

    nodes: int
    ranks_per_node: int = 1
    bandwidth: float = 10e9
    latency: float = 30e-6
    intra_bandwidth: float = 100e9
    oversubscription: float = 1.0
    efficiency: float = 0.94
    transport_rate: float = math.inf
    cpu_per_byte: float = 0.0
    send_buffer: float = 0.0
    burst: float = 0.0
    comm_cores: float = 0.0
    cores_per_host: float = 16.0
    shared_cores: float | None = None
    device: str = "gpu"

    def __post_init__(self):
        for name in ("nodes", "ranks_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ClusterError(f"{name} must be a whole number >= 1, got {v!r}")
        for name in ("bandwidth", "intra_bandwidth", "efficiency", "transport_rate", "cores_per_host"):
            if not getattr(self, name) > 0:
                raise ClusterError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.latency < 0 or self.cpu_per_byte < 0 or self.send_buffer < 0 or self.burst < 0 or self.comm_cores < 0 \
                or not self.oversubscription >= 1 or self.efficiency > 1:
            raise ClusterError(f"latency, cpu_per_byte, send_buffer, burst and comm_cores >= 0, oversubscription >= 1, "
                               f"efficiency <= 1: {self}")
        if self.shared_cores is not None and not self.shared_cores > 0:
            raise ClusterError(f"shared_cores must be positive, got {self.shared_cores!r}")
        if self.device not in ("cpu", "gpu"):
            raise ClusterError(f"device must be cpu or gpu, got {self.device!r}")

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def host_cores(self) -> float:
        """Cores one host has for itself (emulated hosts divide the machine's among them)."""
        return self.shared_cores / self.nodes if self.shared_cores is not None else self.cores_per_host

    def link_bytes_per_s(self) -> float:
        """Payload bytes/s a host's link carries each direction, with every host sending."""
        return self.bandwidth / 8 * self.efficiency / self.oversubscription

    def with_(self, **changes) -> "Cluster":
        return replace(self, **changes)

    def describe(self) -> str:
        where = f"{self.shared_cores:g} shared cores" if self.shared_cores else f"{self.cores_per_host:g} cores/host"
        return (f"{self.nodes} nodes x {self.ranks_per_node} ranks, {self.bandwidth / 1e9:g} Gbit/s, "
                f"{self.latency * 1e6:.0f} us, {self.device}, {where}")


class Host:
    """One host's resources in an Engine, and the activities that move bytes over them."""

    def __init__(self, engine: Engine, cluster: Cluster, name: str = "host"):
        self.engine, self.cluster = engine, cluster
        c = cluster
        rate = c.link_bytes_per_s()
        self.out = Resource(f"{name} out", rate)
        self.into = Resource(f"{name} in", rate)
        # intra_bandwidth is between two ranks: each of the node's ranks copies to its neighbour at that rate.
        self.shm = Resource(f"{name} shm", c.intra_bandwidth / 8 * c.ranks_per_node)
        self.cores = Pool(f"{name} cores", c.host_cores)
        # Compute: on the cores (CPU training) or on each rank's GPU (one per rank, never shared).
        self.device = self.cores if c.device == "cpu" else Pool(f"{name} gpus", c.ranks_per_node)
        # A progress thread that drives (runtime.progress: wfbp's, where compute is off the host) polls without
        # sleeping only while the training thread waits for its exchange; while the training thread computes
        # it backs off (sleeps of 10-100 us), which this leaves out.
        self.drives = False
        self._polling = self._waiting = False

    def polling(self, on: bool) -> None:
        """Its ranks' progress threads start or stop taking comm_cores each (see Pool.reserved): while an exchange
        is pending, or for threads that drive, while one is pending and the training thread waits for it."""
        self._polling = on
        self._reserve()

    def waiting(self, on: bool) -> None:
        """Its ranks' training threads start or stop waiting for their exchanges (after the backward)."""
        self._waiting = on
        self._reserve()

    def _reserve(self) -> None:
        on = self._polling and (self._waiting or not self.drives)
        self.cores.reserved = self.cluster.comm_cores * self.cluster.ranks_per_node if on else 0.0

    def compute(self, name: str, seconds: float, cores_per_rank: float = 1.0) -> Activity:
        """All of this host's ranks computing for `seconds` each, in step, as profiled.

        cores_per_rank: what one rank's compute kept busy while it was profiled (on CPUs, the machine's
        cores over the ranks computing at once; a GPU: 1). At full speed compute loads the pool by that
        much per rank; anything else on the pool then slows it in proportion.
        """
        per_unit = self.cluster.ranks_per_node * (cores_per_rank if self.device is self.cores else 1.0)
        return Activity(name, seconds, loads=((self.device, per_unit),), cap=1.0)

    def transfer(self, name: str, nic_bytes: float, shm_bytes: float = 0.0, cpu_bytes: float | None = None,
                 duplex: bool = True) -> Activity:
        """One connection's worth of traffic: `nic_bytes` out of (and, duplex, into) the host link, and
        `shm_bytes` between its own ranks, in step; `cpu_bytes` copied by its cores (default: all of it).

        The unit of progress is a byte on the network link (or, with none, in shared memory), so that
        concurrent connections share a link byte for byte, as TCP's do.
        """
        c = self.cluster
        if nic_bytes <= 0 and shm_bytes <= 0:
            return Activity(name, 0.0, uses=((self.out, 1.0),))
        amount = nic_bytes if nic_bytes > 0 else shm_bytes
        uses = []
        if nic_bytes > 0:
            uses += [(self.out, 1.0)] + ([(self.into, 1.0)] if duplex else [])
        if shm_bytes > 0:
            uses.append((self.shm, shm_bytes / amount))
        copied = nic_bytes + shm_bytes if cpu_bytes is None else cpu_bytes
        per_unit = c.cpu_per_byte * copied / amount
        loads = ((self.cores, per_unit),) if per_unit > 0 else ()
        return Activity(name, amount, uses=uses, loads=loads, cap=c.transport_rate)
