"""The baseline: one ring allreduce per dtype buffer once backward is over (or a reduce-scatter for PTO)."""

from __future__ import annotations

from ..comm_hooks import GradBucket, allreduce_hook
from ..strategy import Strategy, StrategyContext, wait_handles
from .collectives import dense_collectives


class AllreduceSync(Strategy):
    """Every gradient in one fused buffer per dtype, averaged after backward through the comm hook.

    With ctx.shard_gradients (PTO) only the reduce-scatter half runs: this
    rank's block of the averaged flat gradient is left in `grad_shard`, and
    .grad keeps the local values, unless `finish(full=True)` asks for the
    whole average (synchronize() before step(), to read or clip gradients).
    """

    name = "allreduce"
    hooks = True
    can_shard_gradients = True

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        # Shapes, dtypes and the order of calls were agreed when wrapping and are checked every
        # step; a fingerprint exchange per collective would only add latency.
        self.ring = dense_collectives(ctx)
        self.hook_state, self.hook = None, allreduce_hook  # register_comm_hook may replace them
        by_buffer = [[] for _ in self.buffers.flats]
        for p, (b, _, _) in zip(self.params, self.buffers.segments):
            by_buffer[b].append(p)
        self.buckets = [GradBucket(b, flat, by_buffer[b], self.ring, b) for b, flat in enumerate(self.buffers.flats)]
        self._shard = None
        self._handles: list = []

    def finish(self, used, full: bool = False) -> None:
        tl = self.timeline
        if self.ctx.shard_gradients and not full:
            span = tl.begin("reduce-scatter (fused)", "sync", track="comm") if tl else None
            self._handles = [self.ring.reduce_scatter(self.buffers.flats[0], tag=0)]
            (shard,) = wait_handles(self._handles, "reduce-scatter of the gradients", self.ctx, self._report)
            self._shard = shard.div_(self.size)
        else:
            span = tl.begin("allreduce (fused)", "sync", track="comm") if tl else None
            self._shard = None
            self._handles = [self.hook(self.hook_state, b) for b in self.buckets]
            results = wait_handles(self._handles, "allreduce of the gradients", self.ctx, self._report)
            for bucket, result in zip(self.buckets, results):
                _copy_back(bucket, result)
        self._handles = []
        if span is not None:
            tl.end(span)

    def _report(self) -> str:
        return f"ring step waits for its left neighbour, rank {self.ring.left}"

    @property
    def grad_shard(self):
        return self._shard

    def abort(self) -> None:
        for h in self._handles:
            h.cancel()
        self._handles = []

    def close(self) -> None:
        self.ring.free()


def _copy_back(bucket: GradBucket, result) -> None:
    """A hook may complete with another tensor (decompressed elsewhere): the buffer must hold the average."""
    buf = bucket.buffer()
    if result is None or result.numel() != buf.numel():
        raise ValueError(f"communication hook returned {None if result is None else tuple(result.shape)} for "
                         f"bucket {bucket.index} of {buf.numel()} elements: it must complete with the averaged bucket")
    if result.data_ptr() != buf.data_ptr():
        buf.copy_(result.reshape(-1))
