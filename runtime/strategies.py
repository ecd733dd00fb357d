"""Gradient synchronisation strategies: allreduce after backward, wait-free backprop, and P3 slices."""

from __future__ import annotations

import torch

from mpicomm import Ring, slice_tag
from mpicomm.progress import HandleTask, ProgressThread
from mpicomm.sliced_ps import SlicedExchange

DEFAULT_FUSE_BYTES = 1 << 20  # wfbp: gradients smaller than this share a bucket of about this size
DEFAULT_SLICE_SIZE = 262_144  # elements (1 MiB of float32): per-slice Python cost makes smaller slices slow here; BENCHMARKS.md


class Strategy:
    """What a strategy tells the optimizer wrapper: when gradients are final and averaged."""

    name = "base"
    layerwise = False  # True: updates are applied per layer, in the next forward pass

    def __init__(self, comm, params: list[torch.nn.Parameter], timeline=None):
        self.comm, self.params, self.timeline = comm, params, timeline
        self.size = comm.Get_size()
        self.index = {id(p): i for i, p in enumerate(params)}

    def grad_ready(self, i: int, grad: torch.Tensor) -> None:
        """Backward produced parameter i's final gradient (hook); may start sending it."""

    def finish(self) -> None:
        """Backward is over and every gradient has been handed to grad_ready."""

    def wait(self, i: int) -> None:
        """Block until parameter i's gradient is the average over ranks."""

    def close(self) -> None:
        pass


class AllreduceSync(Strategy):
    """Baseline: one fused ring allreduce of every gradient once backward is over.

    reduce_scatter_only (for PTO): only the reduce-scatter half runs; this
    rank's block of the averaged, flattened gradients is left in
    `grad_shard` and the parameters' own .grad keep their local values.
    """

    name = "allreduce"

    def __init__(self, comm, params, timeline=None, reduce_scatter_only: bool = False):
        super().__init__(comm, params, timeline)
        self.ring = Ring(comm)
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype if params else torch.float32)
        self.grads: list = [None] * len(params)
        self.reduce_scatter_only = reduce_scatter_only
        self.grad_shard = None

    def grad_ready(self, i, grad):
        self.grads[i] = grad

    def finish(self):
        views = _pack(self.grads, self.flat)
        tl = self.timeline
        if self.reduce_scatter_only:
            span = tl.begin("reduce-scatter (fused)", "sync", track="comm") if tl else None
            self.grad_shard = self.ring.reduce_scatter(self.flat).wait().div_(self.size)
        else:
            span = tl.begin("allreduce (fused)", "sync", track="comm") if tl else None
            self.ring.allreduce(self.flat).wait()
            self.flat.div_(self.size)
            _unpack(self.flat, views)
        if span is not None:
            tl.end(span)

    def close(self):
        self.ring.free()


class WfbpSync(Strategy):
    """Poseidon's wait-free backprop: a gradient's allreduce starts the moment backward produces it.

    Gradients under `fuse_bytes` are fused into buckets of about that size, as
    DDP does, so a model of many small tensors (biases, norms) pays one message
    per bucket instead of one per tensor. Buckets are fixed at wrap time in
    reverse registration order (roughly the order backward produces them), the
    same on every rank; a bucket starts when all of its gradients exist.
    """

    name = "wfbp"

    def __init__(self, comm, params, timeline=None, fuse_bytes: int = DEFAULT_FUSE_BYTES):
        super().__init__(comm, params, timeline)
        # Validation would add a collective per bucket in hook order; the structure was checked
        # at wrap time and tags are keyed by bucket, so order between ranks cannot mix data.
        self.ring = Ring(comm, validate=False)
        self.progress = ProgressThread("mpitrain-wfbp")
        self.buckets = _buckets(params, fuse_bytes)
        self.bucket_of = {i: b for b, idxs in enumerate(self.buckets) for i in idxs}
        self.flat = [torch.empty(sum(params[i].numel() for i in idxs), dtype=params[idxs[0]].dtype)
                     if len(idxs) > 1 else None for idxs in self.buckets]
        self.left = [len(idxs) for idxs in self.buckets]
        self.grads: list = [None] * len(params)
        self.futures: list = [None] * len(self.buckets)

    def grad_ready(self, i, grad):
        b = self.bucket_of[i]
        self.grads[i] = grad
        self.left[b] -= 1
        if self.left[b] == 0:
            self.left[b] = len(self.buckets[b])  # ready for the next step
            self._start(b)

    def _start(self, b: int) -> None:
        tl, size, idxs, flat = self.timeline, self.size, self.buckets[b], self.flat[b]
        token = tl.begin(f"allreduce b{b}", "sync", track="comm", bucket=b, params=len(idxs)) if tl else None
        if flat is None:
            buf, views = self.grads[idxs[0]], []
        else:
            buf, views = flat, _pack([self.grads[i] for i in idxs], flat)

        def averaged(handle, buf=buf, views=views, token=token):
            buf.div_(size)
            _unpack(buf, views)
            if tl:
                tl.end(token)

        handle = self.ring.allreduce(buf, tag=slice_tag(self.ring.comm, b, 0, 1))
        self.futures[b] = self.progress.submit(HandleTask(handle, averaged))

    def wait(self, i):
        b = self.bucket_of[i]
        fut = self.futures[b]
        if fut is not None:
            fut.wait()

    def close(self):
        self.progress.stop()
        self.ring.free()


def _pack(grads, flat: torch.Tensor) -> list:
    """Copy gradients one after another into `flat`; returns where each went."""
    views, off = [], 0
    for g in grads:
        flat[off:off + g.numel()].copy_(g.reshape(-1))
        views.append((g, off))
        off += g.numel()
    return views


def _unpack(flat: torch.Tensor, views) -> None:
    for g, off in views:
        g.copy_(flat[off:off + g.numel()].view_as(g))


def _buckets(params, fuse_bytes: int) -> list[list[int]]:
    """Parameter indices grouped into buckets of about fuse_bytes (a large tensor alone), last parameters first."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if nbytes >= fuse_bytes:
            buckets.append([i])
            continue
        if current and params[current[0]].dtype != p.dtype:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        if size >= fuse_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class P3Sync(Strategy):
    """Priority-based parameter propagation over a colocated sharded parameter server."""

    name = "p3"
    layerwise = True

    def __init__(self, comm, params, timeline=None, slice_size: int = DEFAULT_SLICE_SIZE, credit: int = 8):
        super().__init__(comm, params, timeline)
        dtype = params[0].dtype if params else torch.float32
        self.exchange = SlicedExchange(comm, [p.numel() for p in params], slice_size, credit, timeline, dtype)
        self.progress = ProgressThread("mpitrain-p3")
        self.iteration = None
        self.future = None

    def set_priorities(self, priority: list[int]) -> None:
        self.exchange.set_priorities(priority)

    def _current(self):
        if self.iteration is None:
            if self.future is not None:
                # The previous step's receive buffers are reused: it must be fully over (normally is).
                self.future.wait()
            self.iteration = self.exchange.begin()
            self.future = self.progress.submit(self.iteration)
        return self.iteration

    def grad_ready(self, i, grad):
        self._current().ready(i, grad)

    def finish(self):
        self._current()
        self.iteration = None  # the next grad_ready starts the next step

    def wait(self, i):
        it = self.exchange.current
        if it is None:
            return
        ev = it.tensor_done[i]
        while not ev.wait(0.5):
            if self.future is not None and self.future.done():
                self.future.wait()  # re-raises an error of the progress thread
                break

    def close(self):
        self.progress.stop()
        self.exchange.free()


STRATEGIES = {"allreduce": AllreduceSync, "wfbp": WfbpSync, "p3": P3Sync}
