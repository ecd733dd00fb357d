"""The baseline: the gradients allreduced once backward is over (fused, or in pieces where staged; PTO: halves)."""

from __future__ import annotations

from collections import deque

from mpicomm.stall import DRIVE, wait_until

from ..comm_hooks import GradBucket, allreduce_hook
from ..strategy import Strategy, StrategyContext, wait_handles
from .collectives import dense_collectives


class AllreduceSync(Strategy):
    """Every gradient in one fused buffer per dtype, averaged after backward through the comm hook.

    With ctx.shard_gradients (PTO) only the reduce-scatter half runs: this
    rank's block of the averaged flat gradient is left in `grad_shard`, and
    .grad keeps the local values, unless `finish(full=True)` asks for the
    whole average (synchronize() before step(), to read or clip gradients).

    Staged through host memory (a GPU model, or an emulated one's modelled
    copies) with the default hook, the allreduce runs in pieces of about
    `piece_bytes` (whole parameters), two at a time, and each piece's
    average goes back to the device as it completes (`on_averaged`), behind
    the exchange of the rest, instead of the whole gradient after the last
    byte (548 MB for VGG-19).
    """

    name = "allreduce"
    hooks = True
    can_shard_gradients = True
    piece_bytes = 32 << 20  # a piece's copy back (~3 ms over PCIe) overlaps the next piece's exchange
    PIECES_IN_FLIGHT = 2  # the wire stays busy while a finished piece is handed back

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
        # Staged or emulated (a device's copies to model): in pieces; (parameter indices, GradBucket) each.
        self.pieces = self._pieces() if ctx.compute_off_host else []
        self._shard = None
        self._handles: list = []

    def finish(self, used, full: bool = False) -> None:
        tl = self.timeline
        if self.ctx.shard_gradients and not full:
            span = tl.begin("reduce-scatter (fused)", "sync", track="comm") if tl else None
            self._handles = [self.ring.reduce_scatter(self.buffers.flats[0], tag=0)]
            (shard,) = wait_handles(self._handles, "reduce-scatter of the gradients", self.ctx, self._report)
            self._shard = shard.div_(self.size)
        elif self.pieces and self.on_averaged is not None and self.hook is allreduce_hook:
            span = tl.begin(f"allreduce ({len(self.pieces)} pieces)", "sync", track="comm") if tl else None
            self._shard = None
            self._in_pieces()
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

    def _pieces(self) -> list:
        """Each buffer cut at parameter boundaries into pieces of about piece_bytes (`pieces`), memory order."""
        segments, out = self.buffers.segments, []
        for b, flat in enumerate(self.buffers.flats):
            members = sorted((i for i, seg in enumerate(segments) if seg[0] == b), key=lambda i: segments[i][1])
            sizes = [segments[i][2] - segments[i][1] for i in members]
            for run in pieces(sizes, self.piece_bytes // flat.element_size()):
                idxs = [members[j] for j in run]
                out.append((idxs, flat[segments[idxs[0]][1]:segments[idxs[-1]][2]]))
        return [(idxs, GradBucket(k, buf, [self.params[i] for i in idxs], self.ring, k))
                for k, (idxs, buf) in enumerate(out)]

    def _in_pieces(self) -> None:
        """The allreduce piece by piece, PIECES_IN_FLIGHT at once; each average handed back (on_averaged) as its
        piece completes, in order, so that its copy to the device overlaps the exchange of the next ones."""
        pending, inflight = deque(self.pieces), deque()

        def advance() -> bool:
            while True:
                while pending and len(inflight) < self.PIECES_IN_FLIGHT:
                    idxs, bucket = pending.popleft()
                    inflight.append((idxs, bucket, self.hook(self.hook_state, bucket)))
                    self._handles = [h for _, _, h in inflight]
                done = [h.test() for _, _, h in inflight]  # every one tested: each progresses only when tested
                if not done[0]:
                    return False
                idxs, bucket, handle = inflight.popleft()
                self._handles = [h for _, _, h in inflight]
                _copy_back(bucket, handle.wait())
                self.on_averaged(idxs)
                if not inflight and not pending:
                    return True

        wait_until(advance, what="allreduce of the gradients", report=self._report, policy=self.ctx.policy,
                   who=f"rank {self.ctx.topology.rank}: ", interrupt=self.ctx.interrupt, spin=DRIVE)

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


def pieces(sizes: list[int], limit: int) -> list[list[int]]:
    """Positions of consecutive parameters (`sizes` in elements, memory order) cut into runs of at least
    `limit` elements, the last one what is left: the staged allreduce's pieces (the simulator cuts the same)."""
    out, run, total = [], [], 0
    for j, n in enumerate(sizes):
        run.append(j)
        total += n
        if total >= max(1, limit):
            out.append(run)
            run, total = [], 0
    return out + [run] if run else out
