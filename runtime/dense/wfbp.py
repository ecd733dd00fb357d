"""Poseidon's wait-free backprop: a bucket's allreduce starts the moment backward has produced it."""

from __future__ import annotations

from dataclasses import replace

from mpicomm.algorithms import Chooser, CostModel, Layout
from mpicomm.progress import HandleTask, ProgressThread, Window, WindowedTask
from mpicomm.stall import wait_until

from ..comm_hooks import GradBucket, allreduce_hook
from ..device.threads import device_setup
from ..grad_buffers import runs_last_first
from ..options import AUTO
from ..strategy import Strategy, StrategyContext
from .allreduce import _copy_back
from .collectives import dense_collectives


class WfbpSync(Strategy):
    """Buckets of about `fuse_bytes` (a large gradient alone), in reverse registration order (backward's).

    The gradient buffers are laid out bucket by bucket (`layout`), so a bucket
    is a contiguous range of its dtype's buffer, reduced where backward wrote
    it. It is ready when all of its gradients exist; a progress thread starts
    its allreduce (through the comm hook) and drives the collectives while
    backward continues. With `in_flight` (1 by default) at most that many run
    at once, started in bucket order on every rank: ranks that ready them in
    different orders (a branch taken on one rank only) cannot each hold a
    slot the other's bucket needs. Without it, each starts the moment it is
    ready; buckets are tagged by index, so that order may differ by rank.
    """

    name = "wfbp"
    hooks = True
    progress_thread = True

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        self.ring = dense_collectives(ctx)
        self.progress = ProgressThread("mpitrain-wfbp", drive=ctx.compute_off_host,
                                       setup=device_setup(self.buffers.device))  # averages go back from it
        self.hook_state, self.hook = None, allreduce_hook  # register_comm_hook may replace them
        self.bucket_params = buckets(self.params, ctx.options.fuse_bytes)
        self.bucket_of = {i: b for b, idxs in enumerate(self.bucket_params) for i in idxs}
        self.buckets = []
        for b, idxs in enumerate(self.bucket_params):
            buf = self.buffers.segments[idxs[0]][0]
            lo = min(self.buffers.segments[i][1] for i in idxs)
            hi = max(self.buffers.segments[i][2] for i in idxs)
            assert hi - lo == sum(self.params[i].numel() for i in idxs), "buckets must be laid out contiguously"
            self.buckets.append(GradBucket(b, self.buffers.flats[buf][lo:hi], [self.params[i] for i in idxs],
                                           self.ring, b))
        self.left = [len(idxs) for idxs in self.bucket_params]
        self.futures: list = [None] * len(self.buckets)
        w = ctx.options.in_flight  # None: every bucket the moment it is ready
        self.window = Window(w, len(self.buckets)) if w is not None and self.buckets else None
        if self.timeline:  # what fuse_bytes (perhaps "auto", settled) made of this model
            self.timeline.instant("wfbp buckets", "setup", fuse_bytes=ctx.options.fuse_bytes, buckets=len(self.buckets))

    @classmethod
    def settle(cls, options, topology, params):
        if options.fuse_bytes != AUTO:
            return options
        total = sum(p.numel() * p.element_size() for p in params)
        return replace(options, fuse_bytes=auto_fuse_bytes(topology, options.algorithm, total))

    @classmethod
    def layout(cls, params, options, model=None) -> list[int]:
        return [i for bucket in buckets(params, options.fuse_bytes) for i in bucket]

    def staging_groups(self) -> list[list[int]]:
        return self.bucket_params

    def grad_ready(self, i: int) -> None:
        b = self.bucket_of[i]
        self.left[b] -= 1
        if self.left[b] == 0:
            self.left[b] = len(self.bucket_params[b])  # ready for the next step
            self._start(b)

    def _start(self, b: int) -> None:
        tl, bucket, params = self.timeline, self.buckets[b], self.bucket_params[b]
        token = None

        def averaged(handle):
            _copy_back(bucket, handle.wait())
            if self.on_averaged is not None:  # before the future is done: a wait() then finds the copy issued
                self.on_averaged(params)
            if tl:
                tl.end(token)

        def start() -> HandleTask:  # with a window: here if the bucket's turn has come, else on the progress thread
            nonlocal token
            token = tl.begin(f"allreduce b{b}", "sync", track="comm", bucket=b, params=len(params)) if tl else None
            return HandleTask(self.hook(self.hook_state, bucket), averaged)

        task = start() if self.window is None else WindowedTask(self.window, b, start, now=True)
        self.futures[b] = self.progress.submit(task)

    def wait(self, indices) -> None:
        futures = {self.bucket_of[i] for i in indices}
        pending = [self.futures[b] for b in futures if self.futures[b] is not None]

        def done() -> bool:
            for fut in pending:
                if not fut.wait_done(0.05):
                    return False
            return True
        with self.progress.driven():
            wait_until(done, what="wait-free backprop buckets", policy=self.ctx.policy, blocking=True,
                       who=f"rank {self.ctx.topology.rank}: ", interrupt=self.ctx.interrupt,
                       report=lambda: f"buckets {[b for b in futures if not self.futures[b].done()]} wait on the "
                                      f"ring (left neighbour: rank {self.ring.left})")
        for fut in pending:
            fut.wait()  # re-raises an error of the progress thread
        for b in futures:
            self.futures[b] = None

    def abort(self) -> None:
        self.progress.abort()
        for fut in self.futures:
            if fut is not None:
                fut.task.cancel()
        self.futures = [None] * len(self.buckets)
        if self.window is not None:
            self.window.reset()
        self.left = [len(idxs) for idxs in self.bucket_params]

    def close(self) -> None:
        self.progress.stop()
        self.ring.free()


def auto_fuse_bytes(topology, algorithm: str | None, total: int) -> int:
    """Collective: the bucket size of fuse_bytes="auto" for `total` bytes of gradients (CostModel.fuse_size), on
    the layout and the link the buckets' allreduce sees (dense_collectives': the measured link, agreed by every
    rank). A bad algorithm setting falls back to the model's own pick here: building the collectives then says
    what is wrong, on every rank."""
    layout = Layout(topology.size, topology.num_nodes, topology.local_size)  # mpicomm.Collectives' own
    model = CostModel.for_algorithm(topology, algorithm)
    try:
        choose = Chooser(layout, algorithm, model=model).choose
    except ValueError:
        choose = None
    return model.fuse_size(layout, choose, total)


def buckets(params, fuse_bytes: int) -> list[list[int]]:
    """Parameter indices in buckets of about fuse_bytes (a large tensor alone), last parameters first.

    Small gradients (biases between large weights) gather in the open bucket
    across large ones, as DDP's do; a bucket holds one dtype.
    """
    return runs_last_first([p.numel() * p.element_size() for p in params], [p.dtype for p in params], fuse_bytes)
