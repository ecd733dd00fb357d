"""P3 as an event schedule: slices by forward priority, `credit` in flight, each layer gated before its forward."""

from __future__ import annotations

import heapq

from mpicomm.link_probe import LinkEstimate
from runtime.p3 import tuning
from runtime.p3.copy_back import BACK_BYTES

from .collectives import slice_round_trip
from .dataparallel import Run, Schedule, param_layers
from .engine import Event, all_of
from .p3_owners import OwnerExchange

OWNER_RANKS = 32  # the most ranks whose flat exchange is simulated rank by rank (p3_owners)
CARRIED = -1  # the module buffers' vector in the send queue (runtime.p3 carries it as a tensor more)


def p3_settings(run: Run, slice_size="auto", credit="auto") -> tuning.P3Tuning:
    """What runtime.p3.tuning would choose on this cluster: the link probe's figures, from the model of the link."""
    c, p = run.cluster, run.profile
    total = p.grad_bytes
    link = None
    if tuning.needs_probe(c.ranks, total, slice_size, credit):
        # The probe sends to every peer at once: a host's link (or the transport) shared by its ranks.
        rate = min(c.link_bytes_per_s(), c.transport_rate) / c.ranks_per_node if c.nodes > 1 \
            else c.intra_bandwidth / 8
        link = LinkEstimate(rate, 2 * c.latency)
    return tuning.choose(link, total, p.itemsize, c.ranks, slice_size, credit)


class P3Schedule(Schedule):
    """Slices of the flat gradient (registration order), each one's priority its first layer's forward index."""

    deferred = True
    staged = True
    sends_back = True
    distributed_optimizer = True

    def __init__(self, run: Run, **options):
        super().__init__(run, **options)
        self.tuning = p3_settings(run, options.get("slice_size", "auto"), options.get("credit", "auto"))
        sizes, owner = param_layers(self.p)
        n_slice = self.tuning.slice_size
        # Slice s covers elements [s·n, (s+1)·n) of the flat buffer: the layers it touches.
        bounds, a = [], 0
        for n, layer in zip(sizes, owner):
            bounds.append((a, a + n, layer))
            a += n
        total, self.slices = a, []
        for start in range(0, total, n_slice):
            end = min(start + n_slice, total)
            # {layer: its elements in the slice}: the layers it touches, and what its average sends back of each.
            share = {layer: min(hi, end) - max(lo, start) for lo, hi, layer in bounds if lo < end and hi > start}
            self.slices.append((end - start, share))
        self.slices_of = {i: [s for s, (_, ls) in enumerate(self.slices) if i in ls] for i in range(len(self.p.layers))}
        self.messages = len(self.slices)
        # Slices in flight for the host: `credit` outgoing messages per rank. Aggregated, a slice's traffic across the
        # link is its aggregator's (local rank s % L), so the node's L ranks keep L x credit slices on the link; flat,
        # a unit here is one slice of every rank of the host (slice_round_trip), `credit` of them.
        c = run.cluster
        aggregated = options.get("node_aggregation", True) and c.nodes > 1 and c.ranks_per_node > 1
        self.in_flight = self.tuning.credit * (c.ranks_per_node if aggregated else 1)
        # Flat across nodes, with compute off the cores: every rank simulated (p3_owners), where each slice
        # converges on its owner's link. Aggregated, CPU compute (the other nodes' cores would carry compute
        # that is not simulated) or beyond OWNER_RANKS (its cost: 32 ranks take a minute and a half for six
        # steps of ResNet-50): one host stands for all (slice_round_trip), which spreads each slice's
        # traffic over every link.
        self.owners = OwnerExchange(run, self.tuning.credit, self.tuning.relaxed_sleep, self._returned) \
            if c.nodes > 1 and not aggregated and c.device == "gpu" and c.ranks <= OWNER_RANKS else None
        self._elements = sum(l.elements for l in self.p.layers)
        self._ready: list = []  # heap of (priority, slice) ready to send
        self._in_flight = 0
        self._waiting: list[set] = []  # per slice: layers whose gradients it still needs
        self._back: dict[int, Event] = {}  # layer -> fired when all of its slices are back (this step)
        self._layer_left: dict[int, int] = {}
        self._params_ready: dict[int, Event] = {}  # layer -> its average is complete (previous step's)
        self._on_device: dict[int, Event] = {}  # layer -> that average is back on the device (send_back)
        self._back_pending: dict[int, float] = {}  # layer -> bytes of finished slices not yet sent back
        self._back_bytes = 0.0  # their sum
        self._updated: set = set()
        self._holding = False

    @property
    def _holding(self) -> bool:
        """runtime.p3's hold: no new slice from the agreement's start to the buffers' end (rank by rank: no new
        message from any rank's queue)."""
        return self._held

    @_holding.setter
    def _holding(self, on: bool) -> None:
        self._held = on
        if self.owners is not None:
            self.owners.holding = on

    @property
    def carries(self) -> bool:
        """runtime.p3 averages the module buffers' vector in its own exchange (none of them only watched)."""
        return bool(self.p.buffer_elements) and not self.p.watched_buffers and self.run.cluster.ranks > 1

    def agree(self) -> Event | None:
        agreed = super().agree()
        if agreed is not None and self.options.get("yield_link", False) and self.p.buffer_elements \
                and not self.carries:
            self._holding = True
        return agreed

    def buffers_after_step(self, agreed: Event | None = None) -> Event | None:
        """What the next forward waits for. The step's updates are owed before its agreement is in (every layer
        is used: runtime.stepping), so not the agreement, unless the buffers go by MPI's allreduce after it; the
        carried vector (grad_ready) is back."""
        if self.carries:
            return self._carried
        if not self.p.buffer_elements or self.run.cluster.ranks == 1:
            return Event().succeed()
        done = super().buffers_after_step(agreed) or agreed
        if done is not None and self._holding:
            done.then(lambda _: self._release())
        return done

    def _release(self) -> None:
        self._holding = False
        self._send()

    def before_forward(self, i: int, step: int):
        if step == 0:
            return
        yield self._params_ready[i]
        if i not in self._updated:
            # The deferred update takes along every later layer already back (runtime.p3's averaged()).
            along = [j for j in range(i, len(self.p.layers))
                     if j not in self._updated and self._params_ready[j].fired]
            share = sum(self.p.layers[j].elements for j in along) / self._elements
            self._updated.update(along)
            yield all_of(self._on_device[j] for j in along)  # their copies back, started as each completed
            back = self.to_device(along)
            if back is not None:
                yield back
            yield self.run.compute("deferred update", self.p.optimizer_s * share)

    def grad_ready(self, i: int, step: int) -> None:
        if i == len(self.p.layers) - 1:  # the first gradient of this step: a new exchange
            self._waiting = [set(ls) for _, ls in self.slices]
            self._layer_left = {j: len(self.slices_of[j]) for j in range(len(self.p.layers))}
            self._params_ready = {j: Event() for j in range(len(self.p.layers))}
            self._on_device = {j: Event() for j in self._params_ready}
            self._back_pending, self._back_bytes = {}, 0.0
            self._updated = set()
            if self.carries:  # handed over as the step's first gradient is sent: one slice more, the most urgent
                self._carried = Event()
                heapq.heappush(self._ready, (-1, CARRIED))
                self._send()
        copied = self.on_host(i)
        if copied is None:
            self._on_host(i)
        else:
            copied.then(lambda _, i=i: self._on_host(i))

    def _on_host(self, i: int) -> None:
        """Layer i's gradients are on the host: the slices it completes may go."""
        for s in self.slices_of[i]:
            left = self._waiting[s]
            left.discard(i)
            if not left:
                heapq.heappush(self._ready, (min(self.slices[s][1]), s))
        self._send()

    def _hand_over(self) -> None:
        """Rank by rank (p3_owners): every ready slice at once; each rank's credit and queue are the exchange's."""
        owners, P = self.owners, self.run.cluster.ranks
        while self._ready:
            if self._in_flight == 0:
                owners.polling(True)
            _, s = heapq.heappop(self._ready)
            self._in_flight += 1
            if s == CARRIED:  # runtime.p3's own flat buffer after the gradients': its first slice's owner
                owners.ready(s, 8 * self.p.buffer_elements, -1, len(self.slices) % P)
            else:
                owners.ready(s, self.slices[s][0] * self.p.itemsize, min(self.slices[s][1]), s % P)
        owners.pump()

    def _send(self) -> None:
        if self.owners is not None:
            self._hand_over()
            return
        while self._ready and self._in_flight < self.in_flight and not self._holding:
            if self._in_flight == 0:
                self.run.host.polling(True)
            _, s = heapq.heappop(self._ready)
            self._in_flight += 1
            nbytes = 8 * self.p.buffer_elements if s == CARRIED else self.slices[s][0] * self.p.itemsize
            proc = slice_round_trip(self.run.host, nbytes, "module buffers" if s == CARRIED else f"slice {s}",
                                    poll=self.tuning.relaxed_sleep,
                                    aggregate=self.options.get("node_aggregation", True))
            self.run.engine.process(proc).then(lambda _, s=s: self._returned(s))

    def _returned(self, s: int) -> None:
        self._in_flight -= 1
        if self._in_flight == 0 and not self._ready:
            (self.owners or self.run.host).polling(False)
        if s == CARRIED:
            self._carried.succeed()
            self._send()
            return
        finished = []
        for j, n in self.slices[s][1].items():
            self._back_pending[j] = self._back_pending.get(j, 0.0) + n * self.p.itemsize
            self._back_bytes += n * self.p.itemsize
            self._layer_left[j] -= 1
            if self._layer_left[j] == 0:
                finished.append(j)
        # Averages go back a few slices at a time, and at once when a layer completes (runtime.p3.copy_back): the
        # copy engine's queue is in order, so the last copy covers a layer's earlier ones.
        if finished or self._back_bytes >= BACK_BYTES:
            back = self.send_back(self._back_pending, Event().succeed())
            self._back_pending, self._back_bytes = {}, 0.0
            for j in finished:
                back.then(lambda _, j=j: self._on_device[j].succeed())
        for j in finished:
            self._params_ready[j].succeed()
        self._send()

    def finish(self, step: int):
        return iter(())  # step() returns at once: the next forward waits per layer
