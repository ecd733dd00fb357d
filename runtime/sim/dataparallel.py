"""Data-parallel strategies as event schedules: the training step, and when each one's exchanges run."""

from __future__ import annotations

import math

from .cluster import Cluster, Host
from .collectives import (Stream, allgather, allreduce, fuse_size, hierarchical_sparse, queued_allreduce,
                          reduce_scatter, small_allreduce, sparse_allgather)
from .engine import Engine, Event, all_of
from .profile import Profile

DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES = 25 << 20, 1 << 20  # torch DDP's bucket_cap_mb=25 and first bucket
WFBP_FUSE_BYTES = 1 << 20  # runtime.options.DEFAULT_FUSE_BYTES: hybcomm's dense wfbp


class Run:
    """One simulated run: the clock, the representative host and the profile; compute as it was measured."""

    def __init__(self, profile: Profile, cluster: Cluster):
        self.profile, self.cluster = profile, cluster
        self.engine = Engine()
        self.host = Host(self.engine, cluster)
        self.stream = Stream(self.host)
        self._copies_free = 0.0  # when the copy engine is done with the copies queued so far
        self._back_free = 0.0  # the same for the other copy engine: averages back to the device

    def compute(self, name: str, seconds: float) -> Event:
        return self.engine.start(self.host.compute(name, seconds, self.profile.cores_per_rank))

    def copy_s(self, nbytes: float) -> float:
        """A copy between a GPU and pinned host memory at the profile's rate; none for a CPU's profile."""
        rate = self.profile.copy_gbs
        return nbytes / (rate * 1e9) if rate > 0 and self.profile.device == "cuda" else 0.0

    def to_host(self, nbytes: float) -> Event:
        """A gradient's copy to the host on the copy engine, after those queued before it (the host does not
        wait for it: runtime.device's staging copies on a side stream); fires when it is done."""
        start = max(self.engine.now, self._copies_free)
        self._copies_free = start + self.copy_s(nbytes)
        return self.engine.timeout(self._copies_free - self.engine.now)

    def from_host(self, nbytes: float) -> Event:
        """Averages going back to the device as the exchange completes them (runtime.device's averaged()), on
        the other copy engine, after those queued before them; fires when they are there."""
        start = max(self.engine.now, self._back_free)
        self._back_free = start + self.copy_s(nbytes)
        return self.engine.timeout(self._back_free - self.engine.now)


class Schedule:
    """The plain step (forward, backward, optimizer); strategies add their exchanges through the hooks."""

    deferred = False  # True: no wait after backward, each layer waits before its next forward (p3)
    # True: the exchange works on host memory (runtime.device's staging): each layer's gradients go to the host
    # as they are ready and the averages come back before the update, at the profile's copy rate.
    staged = False
    # True: its progress thread drives MPI while the training thread waits, where compute is off the host's cores
    # (runtime.progress.ProgressThread(drive=True): wfbp's, and hybcomm's dense path through it).
    drives = False
    # True (staged): each group's average goes back to the device as its exchange completes it (the strategy calls
    # runtime.device's averaged(): wfbp's buckets, p3's tensors), not all at the update.
    sends_back = False
    # True: a DistributedOptimizer's strategy, which agrees with every rank each step (mpicomm.step_check) and whose
    # runtime.model_buffers averages the buffers after each step (the plain step, "compute", does neither).
    distributed_optimizer = False

    def __init__(self, run: Run, **options):
        self.run, self.p = run, run.profile
        run.host.drives = self.drives and run.cluster.device != "cpu"
        self.options = options
        self.pending: list[Event] = []
        self.unstaged = frozenset()  # layers whose gradients stay on the device (hybcomm's factors go instead)
        self.sent_back: dict[int, float] = {}  # layer -> bytes of its averages back already this step (send_back)

    def on_host(self, i: int) -> Event | None:
        """Staged: layer i's copy to the host, queued now, whose event fires when it is done; else None."""
        if not self.staged or i in self.unstaged or not self.run.copy_s(1):
            return None
        return self.run.to_host(self.p.layers[i].elements * self.p.itemsize)

    def to_device(self, layers) -> Event | None:
        """Staged: the averages of these layers back to the device, before their update (on its stream), less
        what went back as it was averaged (send_back)."""
        nbytes = sum(self.p.layers[i].elements * self.p.itemsize - self.sent_back.pop(i, 0)
                     for i in layers if i not in self.unstaged)
        return self.run.compute("copies to the device", self.run.copy_s(nbytes)) if self.staged and nbytes else None

    def send_back(self, nbytes: dict[int, float], averaged: Event) -> Event:
        """Once `averaged` fires, these averages ({layer: its bytes among them}) go back on the other copy engine
        (sends_back, staged); returns the event of their being on the device (or `averaged` where none go)."""
        nbytes = {i: n for i, n in nbytes.items() if i not in self.unstaged}
        if not (self.sends_back and self.staged and nbytes and self.run.copy_s(1)):
            return averaged
        for i, n in nbytes.items():
            self.sent_back[i] = self.sent_back.get(i, 0) + n
        total = sum(nbytes.values())
        back = Event()
        averaged.then(lambda _: self.run.from_host(total).then(lambda _: back.succeed()))
        return back

    def before_forward(self, i: int, step: int):
        """A process run before layer i's forward (p3: wait for its parameters, apply its update)."""
        return iter(())

    def buffers_after_step(self, agreed: Event | None = None) -> Event | None:
        """runtime.model_buffers: once the step's agreement is in, MPI's own allreduce of the model's
        floating-point buffers, staged in float64, each of its steps queued behind whatever is still on the link
        (collectives.queued_allreduce); waited before the next forward. None where there are none, or one rank."""
        n = self.p.buffer_elements
        if not (self.distributed_optimizer and n and self.run.cluster.ranks > 1):
            return None
        return self.run.engine.process(after(agreed, queued_allreduce(self.run.host, 8 * n, "module buffers")))

    def agree(self) -> Event | None:
        """DistributedOptimizer.step's agreement (mpicomm.step_check), started once the backward is over: one
        small allreduce, queued behind the exchange's bytes already on the link. The strategy's finish waits for
        it, a deferred one's next forward (runtime.stepping). None for one rank, or torch DDP."""
        if self.distributed_optimizer and self.run.cluster.ranks > 1:
            return self.run.engine.process(small_allreduce(self.run.host))
        return None

    def buffers_before_forward(self):
        """A process run before each forward for the buffers (torch DDP: rank 0's broadcast)."""
        return iter(())

    def grad_ready(self, i: int, step: int) -> None:
        """Layer i's gradients exist (backward order: last layer first)."""

    def finish(self, step: int):
        """After backward: wait for the exchange, then the optimizer step."""
        if self.pending:
            yield from self.wait(all_of(self.pending))
            self.pending = []
        yield from self.back()
        yield self.run.compute("optimizer", self.p.optimizer_s)

    def wait(self, exchanges: Event):
        """The training thread waits for its exchanges (Host.waiting, while a driving thread polls flat out)."""
        self.run.host.waiting(True)
        yield exchanges
        self.run.host.waiting(False)

    def back(self):
        back = self.to_device(range(len(self.p.layers)))
        if back is not None:
            yield back


def after(event: Event | None, gen):
    """The process `gen`, once `event` has fired (a gradient's copy to the host)."""
    if event is not None:
        yield event
    yield from gen


def train(run: Run, schedule: Schedule, steps: int) -> list[float]:
    """Simulate `steps` steps; the time each one ended (its optimizer step done, or for p3 its backward)."""
    p, ends = run.profile, []

    def proc():
        buffers = None
        for step in range(steps):
            if buffers is not None:
                yield buffers  # the last step's average written back before this forward (BufferSync.finish)
            yield from schedule.buffers_before_forward()
            for i, layer in enumerate(p.layers):
                yield from schedule.before_forward(i, step)
                yield run.compute(f"forward {layer.name}", layer.fwd_s)
            yield run.compute("loss and the rest", p.other_s)
            for i in reversed(range(len(p.layers))):
                yield run.compute(f"backward {p.layers[i].name}", p.layers[i].bwd_s)
                schedule.grad_ready(i, step)
            agreed = schedule.agree()
            if agreed is not None and not schedule.deferred:
                yield agreed
            yield from schedule.finish(step)
            ends.append(run.engine.now)
            buffers = schedule.buffers_after_step(agreed) or agreed

    run.engine.process(proc())
    run.engine.run()
    if len(ends) != steps:
        raise RuntimeError(f"simulation of {steps} steps ended after {len(ends)}")
    return ends


class AllreduceSchedule(Schedule):
    """One allreduce of every gradient once backward is over and copied (or, with pto, PTO's halves); staged,
    in runtime.dense.allreduce's pieces, each one's averages back to the device as it completes."""

    staged = True
    sends_back = True
    distributed_optimizer = True
    _copied: Event | None = None

    def grad_ready(self, i: int, step: int) -> None:
        self._copied = self.on_host(i)  # the last one, once backward is over: the copies queued before it are done

    def finish(self, step: int):
        nbytes = self.p.grad_bytes
        if self._copied is not None:
            yield self._copied
        if self.options.get("pto"):  # the sharded update reads the averages on the host: none go back
            yield from pto_update(self.run, nbytes)
            return
        if self.staged and self.run.copy_s(1):
            yield from self.in_pieces()
        else:
            yield self.run.engine.process(allreduce(self.run.host, nbytes, algorithm=self.options.get("algorithm")))
        yield from self.back()
        yield self.run.compute("optimizer", self.p.optimizer_s)

    def in_pieces(self):
        """The training thread drives the pieces in turn; each one's averages go back (send_back) behind the
        exchange of the next. Two in flight in the runtime: only their latencies overlap, not modelled."""
        from runtime.dense.allreduce import AllreduceSync, pieces

        sizes, owner = param_layers(self.p)
        back = []
        for k, run in enumerate(pieces(sizes, AllreduceSync.piece_bytes // self.p.itemsize)):
            by_layer: dict[int, int] = {}
            for j in run:
                by_layer[owner[j]] = by_layer.get(owner[j], 0) + sizes[j] * self.p.itemsize
            done = self.run.engine.process(allreduce(self.run.host, sum(by_layer.values()), f"piece {k}",
                                                     self.options.get("algorithm")))
            yield done
            back.append(self.send_back(by_layer, done))
        yield all_of(back)


def pto_update(run: Run, nbytes: float):
    """PTO: reduce-scatter, this rank's 1/P of the optimizer step, allgather of the parameters, which go back to
    the device (a GPU's profile)."""
    P = run.cluster.ranks
    yield run.engine.process(reduce_scatter(run.host, nbytes, native=True, hierarchical=True))
    yield run.compute("sharded optimizer", run.profile.optimizer_s / P)
    yield run.engine.process(allgather(run.host, nbytes / P, "parameter allgather", native=True, hierarchical=True))
    if run.copy_s(nbytes):
        yield run.compute("parameters to the device", run.copy_s(nbytes))


class _Param:
    """What runtime.dense.wfbp.buckets reads of a parameter, so the simulation buckets exactly as it does."""

    def __init__(self, numel: int, itemsize: int):
        self._n, self._s, self.dtype = numel, itemsize, "float"

    def numel(self) -> int:
        return self._n

    def element_size(self) -> int:
        return self._s


def param_layers(p: Profile, skip=frozenset()) -> tuple[list[int], list[int]]:
    """Every parameter's size in elements and its layer's index, registration order (layers in `skip` left out)."""
    sizes, owner = [], []
    for i, layer in enumerate(p.layers):
        if i in skip:
            continue
        for n in layer.params:
            sizes.append(n)
            owner.append(i)
    return sizes, owner


class BucketSchedule(Schedule):
    """Buckets in backward order, each one's allreduce queued the moment its last gradient is on the host."""

    staged = True
    drives = True
    sends_back = True
    distributed_optimizer = True
    fuse_default = "auto"  # WfbpOptions'

    def __init__(self, run: Run, **options):
        super().__init__(run, **options)
        self.buckets = self.layout(options.get("skip", frozenset()))  # [(bytes, {layer indices})]
        self._back_bytes = self.layer_bytes(options.get("skip", frozenset())) if self.sends_back else []
        self._left: list[set] = []

    @property
    def algorithm(self) -> str | None:
        """Each bucket's allreduce: the runtime's auto choice unless the contender names one (wfbp@ring)."""
        return self.options.get("algorithm")

    def layout(self, skip) -> list[tuple[int, set]]:
        return [(sum(by_layer.values()), set(by_layer)) for by_layer in self.layer_bytes(skip)]

    def fuse_bytes(self) -> int:
        """The runtime's bucket size: WfbpOptions' fuse_bytes, "auto" (its default) as auto_fuse_bytes picks
        it on this cluster's layout and link (the chooser the buckets' allreduce takes here)."""
        fuse = self.options.get("fuse_bytes", self.fuse_default)
        return fuse_size(self.run.cluster, self.algorithm, self.p.grad_bytes) if fuse == "auto" else fuse

    def layer_bytes(self, skip) -> list[dict[int, int]]:
        """Per bucket, {layer: the bytes of its parameters in the bucket} (runtime.dense.wfbp's buckets)."""
        from runtime.dense.wfbp import buckets

        sizes, owner = param_layers(self.p, skip)
        params = [_Param(n, self.p.itemsize) for n in sizes]
        out = []
        for b in buckets(params, self.fuse_bytes()):
            by_layer: dict[int, int] = {}
            for j in b:
                by_layer[owner[j]] = by_layer.get(owner[j], 0) + sizes[j] * self.p.itemsize
            out.append(by_layer)
        return out

    def grad_ready(self, i: int, step: int) -> None:
        if not self._left:
            self._left = [set(layers) for _, layers in self.buckets]
        copied = self.on_host(i)  # the bucket's last copy: those of its other layers were queued before it
        for b, left in enumerate(self._left):
            if i in left:
                left.discard(i)
                if not left:
                    done = self.run.stream.submit(after(copied, allreduce(
                        self.run.host, self.buckets[b][0], f"bucket {b}", self.algorithm)))
                    self.pending.append(self.send_back(self._back_bytes[b], done) if self._back_bytes else done)

    def finish(self, step: int):
        self._left = []
        yield from super().finish(step)


class DdpSchedule(BucketSchedule):
    """torch DDP: 25 MiB buckets (the first 1 MiB) in reverse registration order, allreduced in order."""

    staged = False  # gloo's own buffers (runtime.device's staging is DistributedOptimizer's)
    # Not a DistributedOptimizer: no step agreement, and no average of the buffers (rank 0's are broadcast before
    # each forward instead, buffers_before_forward).
    distributed_optimizer = False
    drives = False  # gloo's worker thread reads its sockets blocking
    sends_back = False

    def buffers_before_forward(self):
        """broadcast_buffers (DDP's default): rank 0's buffers (float32) to every rank before the forward may
        start, by gloo's binomial tree: ceil(log2 P) steps of the whole buffer, the first ones (the nearest
        ranks, consecutive ranks sharing a node) inside the node, the rest across."""
        c, n = self.run.cluster, 4 * self.p.buffer_elements
        if not n or c.ranks < 2:
            return
        steps = (c.ranks - 1).bit_length()
        inside = min(steps, (c.ranks_per_node - 1).bit_length())
        for k in range(steps):
            yield self.run.engine.timeout(c.latency)
            nic, shm = (0.0, n) if k < inside else (n, 0.0)
            yield self.run.engine.start(self.run.host.transfer("DDP buffers broadcast", nic, shm, duplex=False))

    @property
    def algorithm(self) -> str:
        return "ring"  # gloo's (and NCCL's) ring, whatever the layout

    def layout(self, skip) -> list[tuple[int, set]]:
        sizes, owner = param_layers(self.p, skip)
        out, cur, size, cap = [], set(), 0, DDP_FIRST_BUCKET_BYTES
        for j in reversed(range(len(sizes))):
            cur.add(owner[j])
            size += sizes[j] * self.p.itemsize
            if size >= cap:
                out.append((size, cur))
                cur, size, cap = set(), 0, DDP_BUCKET_BYTES
        if cur:
            out.append((size, cur))
        return out


def topk_pairs(elements: int, density: float) -> int:
    """runtime.sparse's k for `elements` at `density` (at least one)."""
    return max(1, math.ceil(elements * density))


class TopkSchedule(Schedule):
    """Top-k after backward: the local work (the profile's, selection and summing), the exchange, optimizer."""

    distributed_optimizer = True

    def finish(self, step: int):
        run, p = self.run, self.p
        n = sum(l.elements for l in p.layers)
        density = self.options.get("density", 1e-3)
        k = topk_pairs(n, density)

        def select(elements):
            yield run.compute("top-k local work", elements * p.select_s_per_element)

        if self.options.get("hierarchical"):
            yield run.engine.process(hierarchical_sparse(run.host, n * p.itemsize, k, select))
        else:
            yield from select(n)
            yield run.engine.process(sparse_allgather(run.host, k))
        yield run.compute("optimizer", p.optimizer_s)
