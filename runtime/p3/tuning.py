"""p3's slice size, credit and polling interval, chosen from the link measured at start-up (or as given)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpicomm.link_probe import LinkEstimate, measured_link

AUTO = "auto"
ONLINE = "online"  # credit: auto's to start with, then the fastest of a few tried over the first steps (online_credit)
# A slice should take long enough on the wire that its fixed cost (MPI's and the progress thread's
# per-message work, measured as the small round) is a few percent of it, and short enough that a
# newly ready early-layer slice overtakes queued ones within a few milliseconds (the point of P3).
MIN_SLICE_SECONDS = 2e-3
FIXED_COST_SHARE = 1 / 25  # slice time >= 25 x the per-message round
MIN_SLICE_BYTES, MAX_SLICE_BYTES = 256 << 10, 16 << 20  # BytePS partitions 4 MB by default: within these
SLICES_PER_OWNER = 4  # at least this many slices per rank, so that every owner gets a fair share of the bytes
# Outgoing messages in flight: enough bytes to cover the gaps between a completion and the next send
# (a poll interval, a rendezvous round trip), few enough that preemption stays quick.
IN_FLIGHT_SECONDS = 8e-3
MIN_CREDIT, MAX_CREDIT = 4, 16
# The progress thread's sleep while no layer waits: long enough that polling costs the compute threads
# no core, short enough that the wire never idles. MPI moves a message's bytes only inside its calls: an
# eager send over TCP lies in the socket's buffer, and the rest waits for the next poll. At 2.5 Gbit/s,
# sleeping a quarter of a 0.74 MiB slice (714 us) made p3's exchange of VGG-19 1.5x slower than with
# 100 us (benchmarks/strategies.md): so at most the time the link takes to drain SOCKET_BYTES, and at most a
# quarter of a slice's time.
POLLS_PER_SLICE = 4
SOCKET_BYTES = 64 << 10
MIN_RELAXED_SLEEP, MAX_RELAXED_SLEEP = 50e-6, 1e-3
DEFAULT_RELAXED_SLEEP = 100e-6  # without a measured link (slice size and credit both given)
# Pushes to the node's own aggregator go at most this many times the rate at which the node's link takes the
# node's ranks' bytes (mpicomm.sliced_ps: unpaced, a rank's half of VGG-19's gradients went to its neighbour in
# one burst, and MPICH, busy with it, left both ranks' network traffic unpolled for up to 0.5 s a step). At
# twice, they finish in under half the exchange's time on the link, whatever the node count, so they never
# hold it up. On 4 hosts x 2 at 1 Gbit/s, paced at 1-4 times (60-256 MB/s a rank), p3's exchange alone of VGG-19
# took 7.87-8.07 s a step against 7.98-8.14 s unpaced, and training it 8.21 s against 8.61 s (benchmarks/topology.md).
LOCAL_PACE = 2.0


@dataclass(frozen=True)
class P3Tuning:
    """The exchange's settings, where each came from, and the link they were chosen for (None: not probed)."""

    slice_size: int  # elements
    credit: int
    relaxed_sleep: float  # seconds
    link: LinkEstimate | None
    chosen: tuple[str, ...]  # which settings were "auto"
    local_rate: float | None = None  # bytes a second of pushes inside a node (None: not paced)
    online: bool = False  # credit is where the online trials start (runtime.p3.online_credit)

    def describe(self, itemsize: int = 4) -> str:
        slice_how, credit_how = ("auto" if name in self.chosen else "given" for name in ("slice_size", "credit"))
        credit_how = "auto; online trials start here" if self.online else credit_how
        text = (f"slice {self.slice_size} elements ({self.slice_size * itemsize / 2**20:.2f} MiB, {slice_how}), "
                f"credit {self.credit} ({credit_how}), relaxed poll {1e6 * self.relaxed_sleep:.0f} us")
        if self.local_rate:
            text += f", node pushes paced at {self.local_rate / 2**20:.0f} MiB/s"
        return text + (f"; link: {self.link.describe()}" if self.link else "")


def choose(link: LinkEstimate | None, total_bytes: int, itemsize: int, ranks: int, slice_size=AUTO,
           credit=AUTO, ranks_per_node: int = 1) -> P3Tuning:
    """The settings for a model of `total_bytes` of gradients on `ranks` ranks over `link`: the same everywhere.

    Deterministic in its arguments, so ranks that agree on the link (probe_link
    makes them) agree on the plan. Without a measured link (one rank, or a
    model too small for the link to matter) slices are the smallest allowed
    and every slice may be in flight.
    """
    online = credit == ONLINE
    credit = AUTO if online else credit
    chosen = tuple(name for name, v in (("slice_size", slice_size), ("credit", credit)) if v == AUTO)
    fair = max(MIN_SLICE_BYTES, total_bytes // (SLICES_PER_OWNER * ranks))
    rate = None if link is None or link.bandwidth == float("inf") else link.bandwidth
    if slice_size == AUTO:
        slice_bytes = MIN_SLICE_BYTES
        if rate is not None:
            seconds = max(MIN_SLICE_SECONDS, link.round_time / FIXED_COST_SHARE)
            slice_bytes = int(min(MAX_SLICE_BYTES, fair, max(MIN_SLICE_BYTES, rate * seconds)))
        slice_size = max(1, slice_bytes // itemsize // 1024 * 1024)  # a multiple of 1024 elements
    slice_bytes = slice_size * itemsize
    if credit == AUTO:
        credit = MAX_CREDIT if rate is None else \
            min(MAX_CREDIT, max(MIN_CREDIT, math.ceil(rate * IN_FLIGHT_SECONDS / slice_bytes)))
    relaxed = DEFAULT_RELAXED_SLEEP if rate is None else \
        min(MAX_RELAXED_SLEEP, max(MIN_RELAXED_SLEEP, min(SOCKET_BYTES, slice_bytes / POLLS_PER_SLICE) / rate))
    local = None if rate is None or ranks_per_node < 2 else LOCAL_PACE * ranks_per_node * rate
    return P3Tuning(int(slice_size), int(credit), relaxed, link, chosen, local, online)


def tune(comm, total_bytes: int, itemsize: int, slice_size=AUTO, credit=AUTO, ranks_per_node: int = 1) -> P3Tuning:
    """Collective when the link is probed: something is auto and the model is large enough for it to matter.

    A model of at most SLICES_PER_OWNER smallest slices per rank gets those
    whatever the link (the fair-share bound), so it is not probed: small jobs
    and tests start as fast as before. A probe's result is kept per group of
    ranks for the life of the process (every rank of the group keeps the same),
    so rebuilding an optimizer, as benchmarks do, measures the link once.
    """
    ranks = comm.Get_size()
    probe = needs_probe(ranks, total_bytes, slice_size, credit)
    return choose(measured_link(comm) if probe else None, total_bytes, itemsize, ranks, slice_size, credit,
                  ranks_per_node)


def needs_probe(ranks: int, total_bytes: int, slice_size=AUTO, credit=AUTO) -> bool:
    """Whether the link decides anything: a setting is auto and the model exceeds the fair-share bound."""
    auto = AUTO in (slice_size, credit) or credit == ONLINE
    return auto and ranks > 1 and total_bytes > MIN_SLICE_BYTES * SLICES_PER_OWNER * ranks
