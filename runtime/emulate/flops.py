"""Work per unit call: floating-point operations, bytes moved and kernels launched, forward and backward."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .trace import Call

__all__ = ["Work", "work_of", "KINDS"]

# The op kinds a device rates separately: matrix engines (conv, gemm, attention, recurrent) and memory.
# 3x3 stride-1 convolutions are a kind of their own: cuDNN runs them as Winograd or FFT transforms, with
# fewer multiplications than the direct count here (so their sustained "efficiency" may pass 1).
KINDS = ("conv", "conv3x3", "gemm", "attention", "recurrent", "memory")


@dataclass(frozen=True)
class Work:
    kind: str
    flops: float
    bytes: float
    kernels: int

    def __add__(self, other: "Work") -> "Work":
        return Work(self.kind, self.flops + other.flops, self.bytes + other.bytes, self.kernels + other.kernels)


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def work_of(call: Call, itemsize: int = 4) -> tuple[Work, Work]:
    """(forward, backward) work of one call; backward counts the input gradient and the weights' gradients."""
    m, out = call.module, call.output
    x = call.inputs[0] if call.inputs else out
    act = (x.numel + out.numel) * itemsize
    weights = sum(p.numel() for p in m.parameters()) * itemsize
    needs_dx = bool(call.inputs) and call.inputs[0].dtype.is_floating_point
    if isinstance(m, nn.modules.conv._ConvNd):
        per_out = (m.in_channels // m.groups) * _prod(m.kernel_size)
        f = 2.0 * out.numel * per_out
        kind = "conv3x3" if tuple(m.kernel_size) == (3, 3) and tuple(m.stride) == (1, 1) and m.groups == 1 else "conv"
        fwd = Work(kind, f, act + weights, 1 + (m.bias is not None))
        # wgrad always, dgrad unless the input is the data (the first layer): cuDNN skips it.
        return fwd, Work(kind, f * (1 + needs_dx), 2 * act + 2 * weights, 1 + needs_dx + (m.bias is not None))
    if isinstance(m, nn.Linear):
        rows = out.numel // m.out_features
        f = 2.0 * rows * m.in_features * m.out_features
        return Work("gemm", f, act + weights, 1), Work("gemm", f * (1 + needs_dx), 2 * act + 2 * weights, 2 + needs_dx)
    if isinstance(m, nn.MultiheadAttention):
        return _attention(m, call, itemsize)
    if isinstance(m, nn.RNNBase):
        return _recurrent(m, call, itemsize)
    if isinstance(m, nn.Embedding):
        # Backward writes the whole dense weight gradient (zeroed, then the rows scattered in).
        return Work("memory", 0.0, 2 * out.numel * itemsize, 1), Work("memory", 0.0, 2 * out.numel * itemsize + weights, 2)
    if isinstance(m, (nn.Flatten, nn.Identity, nn.Unflatten)):
        return Work("memory", 0.0, 0.0, 0), Work("memory", 0.0, 0.0, 0)
    if isinstance(m, nn.Dropout) and m.p == 0:
        return Work("memory", 0.0, 0.0, 0), Work("memory", 0.0, 0.0, 0)
    if isinstance(m, (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)):
        # Statistics, then normalise: about two passes over the input forward, three backward.
        return (Work("memory", 8.0 * out.numel, 2 * act, 2),
                Work("memory", 12.0 * out.numel, 3 * act + 2 * weights, 2))
    # Element-wise and pooling: read the input, write the output; backward reads both and writes one.
    return Work("memory", float(out.numel), act, 1), Work("memory", float(out.numel), 1.5 * act, 1)


def _attention(m: nn.MultiheadAttention, call: Call, itemsize: int) -> tuple[Work, Work]:
    q = call.inputs[0].shape
    kv = call.inputs[1].shape if len(call.inputs) > 1 else q
    batch_first = m.batch_first
    b, lq = (q[0], q[1]) if batch_first else (q[1], q[0])
    lk = kv[1] if batch_first else kv[0]
    e = m.embed_dim
    proj = 2.0 * b * (lq * e * e + 2 * lk * e * e + lq * e * e)  # q, k, v in; out
    scores = 2.0 * 2 * b * lq * lk * e  # q k^T, then the weighted sum of v
    flops = proj + scores
    nbytes = (b * (2 * lq + 2 * lk) * e + b * m.num_heads * lq * lk * 2 + 4 * e * e) * itemsize
    return Work("attention", flops, nbytes, 8), Work("attention", 2 * flops, 2 * nbytes, 14)


def _recurrent(m: nn.RNNBase, call: Call, itemsize: int) -> tuple[Work, Work]:
    x = call.inputs[0].shape
    b, t = (x[0], x[1]) if m.batch_first else (x[1], x[0])
    gates = {"LSTM": 4, "GRU": 3}.get(m.mode, 1)
    dirs = 2 if m.bidirectional else 1
    flops, inp = 0.0, m.input_size
    for _ in range(m.num_layers):
        flops += dirs * 2.0 * gates * m.hidden_size * (inp + m.hidden_size) * b * t
        inp = m.hidden_size * dirs
    weights = sum(p.numel() for p in m.parameters()) * itemsize
    # One input GEMM for the whole sequence, then a small kernel pair per time step: launch-bound when short.
    nbytes = (b * t * (x[-1] + gates * m.hidden_size * dirs * m.num_layers)) * itemsize + weights
    kernels = m.num_layers * dirs * (1 + 2 * t)
    return Work("recurrent", flops, nbytes, kernels), Work("recurrent", 2 * flops, 2 * nbytes + weights, 2 * kernels)
