"""Poseidon's cost model: per fully connected layer, is the ring allreduce (PS) or sufficient factors (SFB) faster."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

FORCE = ("auto", "sfb", "ps")


@dataclass(frozen=True)
class Links:
    """The machine the model prices: link rates in bit/s, each direction, and one rank's GEMM rate."""

    inter_bps: float  # bit/s of a node's network link, each direction
    intra_bps: float  # bit/s between two ranks of one node (shared memory)
    gflops: float     # one rank's GEMM rate in GFLOP/s for the SFB rebuild; math.inf: free

    def __post_init__(self):
        for field in ("inter_bps", "intra_bps", "gflops"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{field} must be a positive number, got {value!r}")
        for field in ("inter_bps", "intra_bps"):  # an infinite link would make every layer a tie
            if math.isinf(getattr(self, field)):
                raise ValueError(f"{field} must be finite, got {getattr(self, field)!r}")


@dataclass(frozen=True)
class LayerCost:
    """Both paths priced for one layer and one step, and the path chosen."""

    name: str
    M: int  # inputs
    N: int  # outputs
    bias: bool
    K: int  # rows per rank per step (batch, or batch x positions for a [B, T, M] input)
    P: int  # ranks
    ranks_per_node: int
    ps_numbers: float   # Poseidon: numbers per machine, each direction: 2(MN + N·bias)(P-1)/P
    sfb_numbers: float  # Poseidon: K(P-1)(M+N)  (the bias gradient is Σ δ: no extra numbers)
    ps_link_bytes: int  # bytes over the busiest link per step
    sfb_link_bytes: int
    ps_inter_bytes: int  # bytes leaving one node per step (0 on a single node)
    sfb_inter_bytes: int
    ps_seconds: float
    sfb_seconds: float
    choice: str  # "sfb" or "ps"
    reason: str  # "cost model", "forced", or the caller's reason


def ps_numbers(M: int, N: int, P: int, bias: bool = True) -> float:
    """Numbers a ring allreduce moves over each link, each direction: 2(P-1)/P × (M·N + N·bias).

    Reduce-scatter then allgather: each carries P-1 of the P blocks of the gradient.
    """
    return 2 * (P - 1) / P * (M * N + N * bool(bias))


def sfb_numbers(M: int, N: int, K: int, P: int) -> float:
    """Numbers a ring allgatherv of the factors moves over each link: (P-1) × K × (M+N).

    Every rank's K rows of inputs u (M wide) and of output gradients δ (N wide); each link carries
    P-1 of the P blocks. The bias gradient Σ δ is rebuilt from the same δ rows.
    """
    return float((P - 1) * K * (M + N))


def rebuild_flop(M: int, N: int, K: int, P: int, bias: bool = True) -> int:
    """The SFB rebuild's flop on every rank: W_grad = δ_allᵀ u_all over P·K rows (2·P·K·M·N), and Σ δ (P·K·N)."""
    return 2 * P * K * M * N + P * K * N * bool(bias)


def _link_bps(P: int, ranks_per_node: int, links: Links) -> float | None:
    """The slowest link type on the ring, in bit/s (None: one rank, no link).

    The ring is pipelined, so every link carries the same bytes and the slowest one sets the pace.
    """
    nodes = math.ceil(P / ranks_per_node)
    rates = ([links.inter_bps] if nodes > 1 else []) + ([links.intra_bps] if ranks_per_node > 1 and P > 1 else [])
    return min(rates) if rates else None


def _check(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def layer_cost(name: str, M: int, N: int, K: int, P: int, ranks_per_node: int, links: Links, *,
               bias: bool = True, itemsize: int = 4, force: str = "auto", reason: str | None = None) -> LayerCost:
    """Price one layer of M inputs, N outputs and K rows per rank on P ranks, and choose its path.

    Bytes over a link per step: PS = ps_numbers × itemsize, SFB = sfb_numbers × itemsize (B). A node
    sends the same bytes out of its one ring link when there are several nodes, else nothing.
    Seconds per step:
      ps_seconds  = PS bytes × 8 / link (bit/s); the reduction's additions are ignored (memory
                    bound, and overlapped with the transfer);
      sfb_seconds = SFB bytes × 8 / link (bit/s)
                    + (2·P·K·M·N + P·K·N·bias) flop / (gflops × 1e9 flop/s)  (W_grad = Σ δᵀu over P·K rows, Σ δ).
    link = the slowest link type on the ring (inter_bps across nodes, intra_bps within one); P == 1
    moves nothing: 0 s both ways. choice: `reason` given -> "ps" for that reason (the layer cannot
    use SFB); force "sfb"/"ps" -> that, "forced"; else "sfb" only if strictly faster (ties go to PS).
    """
    for field, value, minimum in (("M", M, 1), ("N", N, 1), ("K", K, 0), ("P", P, 1),
                                  ("ranks_per_node", ranks_per_node, 1), ("itemsize", itemsize, 1)):
        _check(field, value, minimum)
    if force not in FORCE:
        raise ValueError(f"force must be one of {FORCE}, got {force!r}")
    bias = bool(bias)
    ps_n, sfb_n = ps_numbers(M, N, P, bias), sfb_numbers(M, N, K, P)
    ps_bytes, sfb_bytes = ps_n * itemsize, sfb_n * itemsize
    nodes = math.ceil(P / ranks_per_node)
    bps = _link_bps(P, ranks_per_node, links)
    if bps is None:
        ps_s = sfb_s = 0.0
    else:
        ps_s = ps_bytes * 8 / bps
        sfb_s = sfb_bytes * 8 / bps + rebuild_flop(M, N, K, P, bias) / (links.gflops * 1e9)
    if reason is not None:
        choice = "ps"
    elif force != "auto":
        choice, reason = force, "forced"
    else:
        choice, reason = ("sfb" if sfb_s < ps_s else "ps"), "cost model"
    ps_link, sfb_link = round(ps_bytes), round(sfb_bytes)
    return LayerCost(name, M, N, bias, K, P, ranks_per_node, ps_n, sfb_n, ps_link, sfb_link,
                     ps_link if nodes > 1 else 0, sfb_link if nodes > 1 else 0, ps_s, sfb_s, choice, reason)


def plan(layers: Iterable, rows: int | Mapping[str, int], P: int, ranks_per_node: int, links: Links, *,
         itemsize: int = 4, force: str = "auto", ps_only: Mapping[str, str] | None = None) -> list[LayerCost]:
    """layer_cost for each layer (objects with .name, .M, .N, .has_bias: runtime.hybrid.layers.FCLayer), in order.

    rows: K for every layer, or {name: K} (a layer fed [B, T, M] has K = B·T); ps_only: {name: reason}
    for layers that must go through the dense path whatever the cost.
    """
    ps_only = ps_only or {}
    out = []
    for layer in layers:
        if isinstance(rows, Mapping):
            if layer.name not in rows:
                raise ValueError(f"no row count for layer {layer.name!r}")
            k = rows[layer.name]
        else:
            k = rows
        out.append(layer_cost(layer.name, layer.M, layer.N, k, P, ranks_per_node, links, bias=layer.has_bias,
                              itemsize=itemsize, force=force, reason=ps_only.get(layer.name)))
    return out


def measure_gflops(rows: int = 64, size: int = 1024, seconds: float = 0.2) -> float:
    """This process's sustained GFLOP/s on the rebuild's shape: torch.mm(d.t(), u), d and u (rows, size) float32.

    2 × rows × size² flop per product (a transposed operand, a short inner dimension: slower than a
    square GEMM), repeated for `seconds` after one warm-up: the total over the time taken. Not the
    best of a few products: ranks that share cores would each time a lucky burst while the others
    wait, and price the rebuild several times too cheap (measured: 50 GFLOP/s priced, 8 at work).
    The strategy measures on every rank at once, behind a barrier, and takes the slowest rank's.
    """
    import torch

    for field, value in (("rows", rows), ("size", size)):
        _check(field, value, 1)
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    gen = torch.Generator().manual_seed(0)
    d, u = torch.randn(rows, size, generator=gen), torch.randn(rows, size, generator=gen)
    torch.mm(d.t(), u)
    products, start = 0, time.perf_counter()
    while True:
        torch.mm(d.t(), u)
        products += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * rows * size * size * products / elapsed / 1e9


def emulated_gflops(acc, rows: int = 64, size: int = 1024) -> float:
    """An emulated accelerator's GFLOP/s on measure_gflops' shape: 2 x rows x size² flop over its modelled
    GEMM time (runtime.emulate: ComputeModel.gemm_s), slowed by its compute scale."""
    return 2 * rows * size * size / (acc.model.gemm_s(size, size, rows) * acc.scale) / 1e9


def totals(costs: Iterable[LayerCost], dense_bytes: float | None = None) -> dict:
    """Bytes per step over the busiest link: the FC layers by the plan and all through PS (plus dense_bytes).

    ratio = all-PS / plan (None when the plan moves nothing).
    """
    costs = list(costs)
    planned = sum(c.sfb_link_bytes if c.choice == "sfb" else c.ps_link_bytes for c in costs)
    all_ps = sum(c.ps_link_bytes for c in costs)
    out = dict(fc_plan_bytes=planned, fc_all_ps_bytes=all_ps)
    if dense_bytes is not None:
        planned, all_ps = planned + dense_bytes, all_ps + dense_bytes
        out.update(dense_bytes=dense_bytes, plan_bytes=planned, all_ps_bytes=all_ps)
    out["ratio"] = all_ps / planned if planned else None
    return out


def format_plan(costs: Iterable[LayerCost], *, dense_bytes: float | None = None) -> str:
    """A markdown table of the plan (MB = 10⁶ bytes over the busiest link per step), then the totals."""
    costs = list(costs)
    lines = ["| layer | shape | K | choice | PS MB/step | SFB MB/step | PS ms | SFB ms |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for c in costs:
        choice = c.choice if c.reason == "cost model" else f"{c.choice} ({c.reason})"
        lines.append(f"| {c.name} | {c.M}×{c.N} | {c.K} | {choice} | {c.ps_link_bytes / 1e6:.2f} | "
                     f"{c.sfb_link_bytes / 1e6:.2f} | {c.ps_seconds * 1e3:.2f} | {c.sfb_seconds * 1e3:.2f} |")
    t = totals(costs, dense_bytes)
    lines.append("")
    lines.append(f"FC layers: {t['fc_plan_bytes'] / 1e6:.2f} MB/step by the plan, "
                 f"{t['fc_all_ps_bytes'] / 1e6:.2f} MB/step all-PS")
    if dense_bytes is not None:
        ratio = t["ratio"]
        ratio = "" if ratio is None else f": hybcomm moves {ratio:.2f}× fewer bytes than all-PS" if ratio >= 1 \
            else f": hybcomm moves {1 / ratio:.2f}× more bytes than all-PS"
        lines.append(f"with the other parameters ({dense_bytes / 1e6:.2f} MB/step dense): "
                     f"{t['plan_bytes'] / 1e6:.2f} MB/step by the plan, {t['all_ps_bytes'] / 1e6:.2f} MB/step "
                     f"all-PS{ratio}")
    return "\n".join(lines)
