"""A start-up probe of what each rank's link gives: all-to-all bytes per second, the time of a message round, and of one pairwise step."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .buffers import Buffer
from .doubling import doubling_allreduce, doubling_steps
from .handle import Handle
from .requests import RequestLog
from .tags import check_tag

BIG_TAG, SMALL_TAG, STEP_TAG = 1, 2, 3
BYTES_PER_RANK = 8 << 20  # one timed round: long enough (67 ms at 1 Gbit/s) to outlast a token bucket's burst
SMALL_BYTES = 4096


@dataclass(frozen=True)
class LinkEstimate:
    """What every rank of a communicator agreed it measured (identical on every rank).

    bandwidth: bytes per second one rank sends while sending to every peer at
    once (the slowest rank's; inf on one rank). round_time: seconds for a round
    of small messages to every peer and back (the slowest rank's): the fixed
    cost of a message, MPI's and this process's together. step_time: seconds
    per step of a small allreduce by recursive doubling, every rank with one
    partner at once (the slowest rank's; 0 where not probed): the alpha of
    an allreduce's cost model. Where a host runs more ranks than
    it has cores it is the wait for the partner's turn, not the wire's latency.
    """

    bandwidth: float
    round_time: float
    step_time: float = 0.0

    def describe(self) -> str:
        if self.bandwidth == float("inf"):
            return "no peers"
        return (f"{8 * self.bandwidth / 1e9:.2f} Gbit/s per rank to all peers, {1e6 * self.round_time:.0f} us per "
                f"round, {1e6 * self.step_time:.0f} us per pairwise step")


def probe_link(comm: MPI.Comm, bytes_per_rank: int = BYTES_PER_RANK, rounds: int = 3) -> LinkEstimate:
    """Collective: every rank sends to every peer at once, big messages then small, then a small
    allreduce by recursive doubling, step by step; the ranks agree.

    The all-to-all pattern is what a sharded parameter server (p3) puts on
    the links: each rank's egress is shared by its P-1 flows, so the figure is
    the rate one rank can push, not one flow's. The fastest of `rounds` timed
    rounds of each size (after one untimed) gives the figure: slower ones
    were disturbed (a rank descheduled, a burst of other traffic), none can
    beat the link. Every rank then takes the slowest rank's figures,
    so that decisions made from them are the same everywhere.
    """
    size = comm.Get_size()
    if size == 1:
        return LinkEstimate(float("inf"), 0.0)
    c = comm.Dup()
    try:
        check_tag(c, STEP_TAG)
        peers = [p for p in range(size) if p != c.Get_rank()]
        big = max(SMALL_BYTES, min(4 << 20, bytes_per_rank // len(peers)))
        send = np.ones(big, dtype=np.uint8)
        recv = np.empty((len(peers), big), dtype=np.uint8)
        big_times = [_round(c, peers, send, recv, big, BIG_TAG) for _ in range(rounds + 1)][1:]
        small_times = [_round(c, peers, send, recv, SMALL_BYTES, SMALL_TAG) for _ in range(2 * rounds + 1)][1:]
        small = np.zeros(SMALL_BYTES // 4, dtype=np.float32)
        step_times = [_steps(c, small, STEP_TAG) for _ in range(2 * rounds + 1)][1:]
        mine = np.array([-len(peers) * big / min(big_times), min(small_times), min(step_times)])
        c.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)  # the lowest bandwidth, the longest round and step
        return LinkEstimate(float(-mine[0]), float(mine[1]), float(mine[2]))
    finally:
        c.Free()


def _round(comm: MPI.Comm, peers: list[int], send: np.ndarray, recv: np.ndarray, n: int, tag: int) -> float:
    """Seconds for this rank to send n bytes to every peer and receive n bytes from each, all at once."""
    comm.Barrier()
    t0 = time.perf_counter()
    reqs = [comm.Irecv([recv[k, :n], MPI.BYTE], p, tag) for k, p in enumerate(peers)]
    reqs += [comm.Isend([send[:n], MPI.BYTE], p, tag) for p in peers]
    MPI.Request.Waitall(reqs)
    return time.perf_counter() - t0


def _steps(comm: MPI.Comm, data: np.ndarray, tag: int) -> float:
    """Seconds per step of this layer's recursive-doubling allreduce of `data`: its Python, its waits and the
    partner's turn on a busy host included, as every algorithm's steps pay them."""
    log = RequestLog("link probe")
    comm.Barrier()
    t0 = time.perf_counter()
    Handle("link probe", doubling_allreduce(comm, Buffer(data, checked=True), "sum", tag, log), log).wait()
    return (time.perf_counter() - t0) / doubling_steps(comm.Get_size())


_LINKS: dict[tuple[int, ...], LinkEstimate] = {}


def measured_link(comm) -> LinkEstimate:
    """probe_link(comm), once per group of ranks (by their COMM_WORLD ranks) in this process."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        key = tuple(group.Translate_ranks(list(range(group.Get_size())), world))
    finally:
        group.Free()
        world.Free()
    if key not in _LINKS:
        _LINKS[key] = probe_link(comm)
    return _LINKS[key]
