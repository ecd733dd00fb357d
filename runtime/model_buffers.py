"""Module buffers (BatchNorm running statistics) kept equal on every rank: averaged, or rank 0's, each step."""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from mpicomm.requests import abandon
from mpicomm.stall import StallPolicy, wait_until

from .buffer_selection import synced_buffers
from .trace import span_of

MODES = ("average", "broadcast", "none")


class _Pack:
    """The sent and watched buffers on one device, and their slice of the host vector: [values | flags].

    On a GPU the buffers are packed into a float64 vector on the device (one
    foreach copy), which goes to the pinned host slice in one non-blocking
    copy, and the average comes back in one, on the current stream, ahead of
    the next forward. A watched buffer's flag is 1 where it differs from its
    value when wrapped (NaN counts as a change). On the CPU the host slice is
    packed directly.
    """

    def __init__(self, sent: list[torch.Tensor], watched: list[torch.Tensor], host: torch.Tensor):
        self.sent, self.watched, self.host = sent, watched, host
        self.device = (sent or watched)[0].device
        self.cuda = self.device.type == "cuda"
        self.nvalues = sum(b.numel() for b in sent)
        work = torch.zeros(host.numel(), dtype=torch.float64, device=self.device) if self.cuda else host
        self.work = work
        bounds = np.cumsum([0] + [b.numel() for b in sent])
        self.views = [work[a:z].view(b.shape) for b, a, z in zip(sent, bounds[:-1], bounds[1:])]
        self.flags = [work[self.nvalues + k] for k in range(len(watched))]
        self.snapshots = [b.detach().clone() for b in watched]
        # Where each watched buffer differs from its snapshot: kept, so that no step allocates a compare's result.
        self.masks = [torch.empty(b.shape, dtype=torch.bool, device=b.device) for b in watched]
        if self.cuda:
            self.copied = torch.cuda.Event(blocking=True)  # the host waits on it: no spinning
            self.returned = torch.cuda.Event(blocking=True)  # the last average unpacked: the next pack waits for it
            self._returned = False

    def gather(self) -> int:
        """Pack the buffers and their flags and start the copy to the host; returns the copies issued."""
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda and self._returned:  # the pinned slice and the work vector are free again
            stream.wait_event(self.returned)
        if self.sent:
            torch._foreach_copy_(self.views, [b.detach() for b in self.sent])
        for flag, b, snap, mask in zip(self.flags, self.watched, self.snapshots, self.masks):
            flag.copy_(torch.ne(b.detach(), snap, out=mask).any())
        if not self.cuda:
            return 0
        self.host.copy_(self.work, non_blocking=True)
        self.copied.record(stream)
        return 1

    def wait_copied(self) -> None:
        if self.cuda:
            self.copied.synchronize()

    def scatter(self) -> int:
        """Write the host slice's values back into the sent buffers; returns the copies issued."""
        if not self.sent:
            return 0
        if self.cuda:  # on the current stream: the forward pass that follows reads them after it
            self.work[:self.nvalues].copy_(self.host[:self.nvalues], non_blocking=True)
        torch._foreach_copy_([b.detach() for b in self.sent], self.views)
        if not self.cuda:
            return 0
        self.returned.record(torch.cuda.current_stream(self.device))  # the host slice and `work` read
        self._returned = True
        return 1

    def changed(self) -> list[torch.Tensor]:
        """The watched buffers whose summed flag in the host slice is non-zero (the same on every rank)."""
        flags = self.host[self.nvalues:].numpy()
        return [b for b, f in zip(self.watched, flags) if f != 0]

    def settle(self) -> None:
        """Before the pack is dropped: its copies are complete."""
        if self.cuda and self._returned:
            self.returned.synchronize()


class BufferSync:
    """Averages (or broadcasts rank 0's) floating-point buffers after every step, off the critical path.

    Each rank's BatchNorm sees only its own samples, so its running mean and
    variance drift away from the others' and evaluation would differ by rank.
    `start()` (in step()) packs the buffers into one float64 vector in host
    memory (on a GPU: one copy from the device, into pinned memory) and
    starts one non-blocking MPI allreduce (or broadcast); `finish()` (before
    the next forward pass, or before evaluation, checkpoints and close)
    writes the result back (on a GPU: one non-blocking copy, on the current
    stream). "average" gives every rank the mean over ranks (a better
    estimate than any one rank's); "broadcast" is DDP's behaviour. Which
    buffers travel: `synced_buffers`; a watched buffer found changed on some
    rank is averaged at once (one blocking allreduce) and sent from then on.
    On a GPU the pack is queued on the current stream of step(), behind the
    forward pass that wrote the buffers when it ran on that stream (a
    forward pass on another stream must be joined to it first, as for the
    gradients), and the host waits for that one copy alone.

    Carried (`carry(strategy)`, where `carryable`): the strategy's own exchange
    averages the vector with the step's gradients instead (p3: as a slice more,
    the most urgent). `hand_over()` packs it and hands it over as the step's
    first gradient is sent (the step's forward passes are over), so it goes
    ahead of the exchange's bulk, not queued behind it after the step's
    agreement as MPI's own allreduce is (benchmarks/claims.md, twentieth
    pass); `finish()` waits for it.
    """

    def __init__(self, model: torch.nn.Module, comm: MPI.Comm, mode: str, policy: StallPolicy, interrupt=None,
                 timeline=None):
        if mode not in MODES:
            raise ValueError(f"buffers must be one of {MODES}, got {mode!r}")
        self.mode, self.policy, self.interrupt, self.timeline = mode, policy, interrupt, timeline
        self.buffers, self.watched = synced_buffers(model, mode)
        self.size = comm.Get_size()
        # Its own communicator: after a failure the step agreement's collectives must be its alone
        # (mpicomm.step_check joins rounds that a failed rank left), and MPI matches them in order.
        self.comm = comm.Dup() if self.active else comm
        self.collectives = self.copies_to_host = self.copies_to_device = 0  # issued so far (reported, tested)
        self.carried_rounds = 0  # handed to the carrier so far
        self._request = None
        self.carrier = None  # the strategy whose exchange averages the vector (carry())
        self._carried = False  # a vector handed over, its average not yet written back
        self.handed = False  # ...in the step in progress (its owner clears it as the step ends)
        self._layout()

    @property
    def active(self) -> bool:
        return bool(self.buffers or self.watched) and self.size > 1

    @property
    def carryable(self) -> bool:
        """Whether a strategy's exchange may average the vector: averaged, one device, and no buffer only watched
        (one that changed would be sent from then on: the vector's layout would change under the exchange)."""
        return self.active and self.mode == "average" and len(self.packs) == 1 and not self.watched

    @property
    def vector(self) -> torch.Tensor:
        """The float64 host vector that is averaged (pinned where a buffer is on a GPU)."""
        return self.packs[0].host

    def carry(self, carrier) -> None:
        """From now on `carrier`'s exchange averages the vector (Strategy.carries_buffers); start() does nothing."""
        if not self.carryable:
            raise ValueError("these module buffers cannot be carried by a strategy's exchange")
        self.carrier = carrier

    def _layout(self) -> None:
        """One pack per device (a model's buffers are on one), each a slice of the host vector MPI reduces."""
        if not self.active:
            self.packs, self.staging = [], np.zeros(0)
            return
        devices = list(dict.fromkeys(b.device for b in self.buffers + self.watched))
        groups = [([b for b in self.buffers if b.device == d], [b for b in self.watched if b.device == d])
                  for d in devices]
        sizes = [sum(b.numel() for b in sent) + len(watched) for sent, watched in groups]
        pin = any(d.type == "cuda" for d in devices)
        host = torch.zeros(sum(sizes), dtype=torch.float64, pin_memory=pin)
        bounds = np.cumsum([0] + sizes)
        self.packs = [_Pack(sent, watched, host[a:z]) for (sent, watched), a, z in zip(groups, bounds[:-1], bounds[1:])]
        self.staging = host.numpy()

    def start(self) -> None:
        """After the step's agreement: pack the buffers and start MPI's allreduce (or broadcast) of them."""
        if not self.active or self.carrier is not None:
            return
        self._pack()
        if self.mode == "average":
            self._request = self.comm.Iallreduce(MPI.IN_PLACE, self.staging)
        else:
            self._request = self.comm.Ibcast(self.staging, root=0)
        self.collectives += 1

    def hand_over(self) -> None:
        """Carried: pack the buffers and hand the vector to the carrier's exchange of this step."""
        self._pack()
        self.carrier.carry_ready()
        self._carried = self.handed = True
        self.carried_rounds += 1

    def _pack(self) -> None:
        self.finish()
        with torch.no_grad():
            self.copies_to_host += sum(pack.gather() for pack in self.packs)
            for pack in self.packs:
                pack.wait_copied()

    def finish(self) -> None:
        """Before the next forward (evaluation, a checkpoint): the average written back into the buffers."""
        if self._carried:
            with span_of(self.timeline, "wait module buffers", "sync"):
                self.carrier.wait_carried()  # the exchange's own stall policy and failure checks
            self._carried = False
            self._write_back()  # averaged already: the exchange divides its sums by the ranks
            return
        req = self._request
        if req is None:
            return
        # On the timeline: behind bulk traffic this wait can be long (benchmarks/claims.md, ninth pass).
        with span_of(self.timeline, "wait module buffers", "sync"):
            wait_until(req.Test, what="averaging module buffers", policy=self.policy,
                       who=f"rank {self.comm.Get_rank()}: ", report=lambda: "a native MPI allreduce of the buffers",
                       interrupt=self.interrupt)
        self._request = None
        if self.mode == "average":
            self.staging *= 1.0 / self.size
        self._write_back()

    def _write_back(self) -> None:
        with torch.no_grad():
            self.copies_to_device += sum(pack.scatter() for pack in self.packs)
        changed = [b for pack in self.packs for b in pack.changed()]
        if changed:
            self._promote(changed)

    def _promote(self, changed: list[torch.Tensor]) -> None:
        """Watched buffers that changed on some rank (every rank has the same list): averaged now, sent from now on.

        Rare (a cache rebuilt, a constant edited): one allreduce of their values, waited for at once (as the
        others are: a failure elsewhere stops it, not a hang).
        """
        values = np.concatenate([b.detach().reshape(-1).double().cpu().numpy() for b in changed])
        req = self.comm.Iallreduce(MPI.IN_PLACE, values)
        try:
            wait_until(req.Test, what="averaging changed module buffers", policy=self.policy,
                       who=f"rank {self.comm.Get_rank()}: ", report=lambda: "a native MPI allreduce of the buffers",
                       interrupt=self.interrupt)
        except BaseException:
            abandon(req, "module buffers: changed ones", keep=(values,))  # MPI writes `values` once all ranks post
            raise
        self.collectives += 1
        values *= 1.0 / self.size
        with torch.no_grad():
            for b, v in zip(changed, np.split(values, np.cumsum([b.numel() for b in changed])[:-1])):
                b.copy_(torch.from_numpy(v).view(b.shape))
        for pack in self.packs:
            pack.settle()
        ids = {id(b) for b in changed}
        self.buffers += changed
        self.watched = [b for b in self.watched if id(b) not in ids]
        self._layout()

    def free(self) -> None:
        """Normal end only (a failed run keeps the communicator: its collective may still be in flight)."""
        self._carried = self.handed = False  # close() wrote the last average back (an open step was aborted)
        if self.active:
            self.finish()  # every rank posted the last one (step() does, after the step's agreement)
            self.comm.Free()

    def abandon(self) -> None:
        """Error path: a collective cannot be cancelled; it is completed in the background (mpicomm.requests)."""
        abandon(self._request, "module buffers", keep=(self.staging,))
        self._request = None
        self._carried = self.handed = False  # the carrier aborts its own exchange
