"""What moving bytes costs here: a connection's rate, CPU per byte and latency; a ring allreduce's and a chain's rates."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
from mpi4py import MPI

from .ring import Ring
from .tags import check_tag

BIG_TAG, SMALL_TAG = 11, 12


@dataclass(frozen=True)
class TransportEstimate:
    """rate: bytes/s one connection moves each way with both ways busy (the slowest pair's);
    cpu_per_byte: core-seconds a byte costs its two ends together (sender's and receiver's copies,
    the progress engine's polling while it moves); latency: half a small round trip, seconds."""

    rate: float
    cpu_per_byte: float
    latency: float

    def to_json(self) -> dict:
        return asdict(self)


def probe_transport(comm: MPI.Comm, nbytes: int = 8 << 20, repeats: int = 8, rounds: int = 3) -> TransportEstimate:
    """Collective, on an even number of ranks: rank 2i and 2i+1 exchange `nbytes` both ways `repeats`
    times per round; the best round of each pair, then the slowest pair's figures, on every rank."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 2 or size % 2:
        raise ValueError(f"probe_transport needs an even number of ranks >= 2, got {size}")
    c = comm.Dup()
    try:
        check_tag(c, SMALL_TAG)
        peer = rank ^ 1
        send, recv = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
        best = (np.inf, np.inf)
        for r in range(rounds + 1):
            c.Barrier()
            t0, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(repeats):
                reqs = [c.Irecv([recv, MPI.BYTE], peer, BIG_TAG), c.Isend([send, MPI.BYTE], peer, BIG_TAG)]
                MPI.Request.Waitall(reqs)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            if r and wall < best[0]:
                best = (wall, cpu)
        small = np.zeros(1, dtype=np.float64)
        trips = []
        for _ in range(50):
            t0 = time.perf_counter()
            if rank % 2 == 0:
                c.Send([small, MPI.DOUBLE], peer, SMALL_TAG)
                c.Recv([small, MPI.DOUBLE], peer, SMALL_TAG)
            else:
                c.Recv([small, MPI.DOUBLE], peer, SMALL_TAG)
                c.Send([small, MPI.DOUBLE], peer, SMALL_TAG)
            trips.append(time.perf_counter() - t0)
        moved = repeats * nbytes  # each way; this process sent and received that much
        mine = np.array([-moved / best[0], best[1] / moved, float(np.median(trips[5:])) / 2])
        c.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
        return TransportEstimate(float(-mine[0]), float(mine[1]), float(mine[2]))
    finally:
        c.Free()


def probe_ring(comm: MPI.Comm, nbytes: int = 32 << 20, rounds: int = 3) -> dict:
    """Collective: the toolkit's own ring allreduce of `nbytes` (float32, explicit tag as the strategies
    use it), best of `rounds` after one untimed; its payload rate per rank, 2(P-1)/P x nbytes / time, and
    the CPU-seconds per byte it cost, the slowest rank's on every rank."""
    size = comm.Get_size()
    if size < 2:
        raise ValueError("probe_ring needs 2 or more ranks")
    ring = Ring(comm, validate=False)
    try:
        buf = np.ones(nbytes // 4, dtype=np.float32)
        best = (np.inf, np.inf)
        for r in range(rounds + 1):
            comm.Barrier()
            t0, cpu0 = time.perf_counter(), time.process_time()
            ring.allreduce(buf, tag=0).wait()
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            if r and wall < best[0]:
                best = (wall, cpu)
        moved = 2 * (size - 1) / size * buf.nbytes
        mine = np.array([-moved / best[0], best[1] / moved])
        comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
        return {"ring_rate": float(-mine[0]), "ring_cpu_per_byte": float(mine[1])}
    finally:
        ring.free()


def probe_chain(comm: MPI.Comm, nbytes: int = 512 << 10, count: int = 16, rounds: int = 3,
                two_way: bool = False) -> dict:
    """Collective: each rank streams `count` messages of `nbytes` to the next rank, posted back to back, while it
    receives as many from the one before (a pipeline's stages sending their activations on, every link busy one
    way); best of `rounds` after one untimed. Returns {"chain_rate": bytes/s of the slowest stream}.

    two_way: each rank also streams as many to the one before (the gradients going back while the activations go
    on, as in 1F1B), so a middle rank's link carries two streams each way and its own sends' acknowledgements
    queue behind the data coming in. Returns {"chain2_rate": bytes/s of the slowest stream}: half the link's
    share where nothing but the bytes contend."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 2:
        raise ValueError("probe_chain needs 2 or more ranks")
    ends = [p for p in (rank - 1, rank + 1) if 0 <= p < size] if two_way else []
    c = comm.Dup()
    try:
        check_tag(c, BIG_TAG)
        send = np.ones(nbytes, dtype=np.uint8)
        recv = [np.empty(nbytes, dtype=np.uint8) for _ in range(count)]
        recv2 = [np.empty(nbytes, dtype=np.uint8) for _ in range(count)] if len(ends) == 2 else []
        best = np.inf
        for r in range(rounds + 1):
            c.Barrier()
            t0 = time.perf_counter()
            if two_way:  # a buffer set per neighbour: both streams land at once
                reqs = [c.Irecv([buf, MPI.BYTE], p, BIG_TAG) for p, bufs in zip(ends, (recv, recv2)) for buf in bufs]
                reqs += [c.Isend([send, MPI.BYTE], p, BIG_TAG) for p in ends for _ in range(count)]
            else:
                reqs = [c.Irecv([buf, MPI.BYTE], rank - 1, BIG_TAG) for buf in recv] if rank > 0 else []
                if rank < size - 1:
                    reqs += [c.Isend([send, MPI.BYTE], rank + 1, BIG_TAG) for _ in range(count)]
            MPI.Request.Waitall(reqs)
            wall = time.perf_counter() - t0
            if r and wall < best:
                best = wall
        mine = np.array([best if rank > 0 or two_way else 0.0])  # a stream's time is its receiver's
        c.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
        return {"chain2_rate" if two_way else "chain_rate": count * nbytes / float(mine[0])}
    finally:
        c.Free()
