"""Communication hooks, as DDP's register_comm_hook: a plain function and a small state object per bucket."""

#     def hook(state, bucket) -> handle      # mpicomm Handle (or handle.then(...))
#
# `bucket.buffer()` is the bucket's flat gradient; `bucket.allreduce(t)` sums
# t over ranks on the strategy's ring, non-blocking, and returns a handle. The
# hook's handle must complete with the bucket's averaged gradient (the buffer
# itself, or a tensor of its size the strategy copies back). The bucketed
# strategies call it: `allreduce` (a bucket per dtype) and `wfbp` (its
# buckets as each one's turn comes, `in_flight` at once in bucket order: on
# the thread that readied it if its turn has come, else on the progress
# thread).
#
#     dopt.register_comm_hook(CompressionState(), fp16_compress_hook)

from __future__ import annotations

import torch


class GradBucket:
    """One bucket of gradients handed to a hook: a slice of a flat buffer and the ring to reduce it on."""

    __slots__ = ("index", "_buffer", "_params", "_ring", "_tag", "world_size")

    def __init__(self, index: int, buffer: torch.Tensor, params: list, ring, tag: int | None):
        self.index, self._buffer, self._params, self._ring, self._tag = index, buffer, params, ring, tag
        self.world_size = ring.size

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list:
        return self._params

    def allreduce(self, tensor: torch.Tensor):
        """Sum `tensor` (contiguous, any supported dtype) over ranks in place; a handle completing with it."""
        return self._ring.allreduce(tensor, tag=self._tag)


def allreduce_hook(state, bucket: GradBucket):
    """The default: sum, then divide by the number of ranks."""
    size = bucket.world_size
    return bucket.allreduce(bucket.buffer()).then(lambda t: t.div_(size))


class CompressionState:
    """Keeps one wire buffer per bucket and dtype, so compressing allocates nothing after the first step."""

    def __init__(self):
        self._wires: dict = {}

    def wire(self, bucket: GradBucket, dtype: torch.dtype) -> torch.Tensor:
        key = (bucket.index, dtype, bucket.buffer().numel())
        w = self._wires.get(key)
        if w is None:
            w = self._wires[key] = torch.empty(bucket.buffer().numel(), dtype=dtype)
        return w


def _compress_hook(state: CompressionState, bucket: GradBucket, dtype: torch.dtype):
    buf = bucket.buffer()
    wire = state.wire(bucket, dtype)
    # Divided before summing, as DDP does: the sum of P half-precision values cannot overflow then.
    torch.div(buf, bucket.world_size, out=wire)
    return bucket.allreduce(wire).then(lambda w: buf.copy_(w))


def fp16_compress_hook(state: CompressionState, bucket: GradBucket):
    """Send float16: half the bytes, about 3 significant digits (gradients outside ±65504 overflow)."""
    return _compress_hook(state, bucket, torch.float16)


def bf16_compress_hook(state: CompressionState, bucket: GradBucket):
    """Send bfloat16: half the bytes, float32's range, about 2 significant digits."""
    return _compress_hook(state, bucket, torch.bfloat16)


def install_hook(strategy, state, hook, started: bool) -> str:
    """Give a bucketed strategy its hook (refusing where none applies); returns the hook's name for the step checks.

    started: a backward pass has run already (the buckets are in use).
    """
    if not strategy.hooks:
        raise ValueError(f"{strategy.name} does not take communication hooks: they apply to the "
                         "bucketed strategies allreduce and wfbp")
    if started:
        raise RuntimeError("register_comm_hook must be called before the first backward pass")
    if strategy.ctx.shard_gradients:
        raise ValueError(f"{strategy.name} with pto reduce-scatters the gradients: no bucket for a hook "
                         "to average")
    strategy.hook_state, strategy.hook = state, hook
    return getattr(hook, "__name__", type(hook).__name__)
