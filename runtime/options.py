"""Typed, validated settings of each strategy: what `DistributedOptimizer(strategy=...)` accepts."""

from __future__ import annotations

from dataclasses import dataclass, fields

from mpicomm.algorithms import CHOICES as ALLREDUCE_CHOICES

DEFAULT_FUSE_BYTES = 1 << 20  # wfbp: gradients share buckets of about this size
AUTO = "auto"  # p3's slice size and credit: chosen from the link measured when wrapping (runtime.p3.tuning)
ONLINE = "online"  # p3's credit: auto's first, then the fastest of a few tried over the first steps
OPERATORS = ("mstopk", "exact")
GRANULARITIES = ("model", "layer")
HYBCOMM_DENSE = ("wfbp", "p3")  # what hybcomm sends the layers without sufficient factors through
HYBCOMM_FORCE = ("auto", "sfb", "ps")
DEFAULT_INTRA_BANDWIDTH = 40e9  # bit/s between ranks of one node (shared memory), the cost model's default


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_auto_or_int(name: str, value, low: int) -> None:
    if value == AUTO:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be {AUTO!r} or an integer >= {low}, got {value!r}")


def _check_credit(value) -> None:
    if value in (AUTO, ONLINE):
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"credit must be {AUTO!r}, {ONLINE!r} or an integer >= 1, got {value!r}")


def _check_fraction(name: str, value, *, allow_zero: bool = False, allow_one: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        (0 <= value if allow_zero else 0 < value) and (value <= 1 if allow_one else value < 1)
    if not ok:
        lo, hi = "[0" if allow_zero else "(0", "1]" if allow_one else "1)"
        raise ValueError(f"{name} must be in {lo}, {hi}, got {value!r}")


def _check_algorithm(value) -> None:
    if value is not None and value not in ALLREDUCE_CHOICES:
        raise ValueError(f"algorithm must be one of {ALLREDUCE_CHOICES} or None, got {value!r}")


def _check_node_window(value) -> None:
    if value is not True and value is not False and value != AUTO:
        raise ValueError(f"node_window must be True, False or {AUTO!r}, got {value!r}")


def _check_flags(options, *flags: str) -> None:
    for flag in flags:
        if not isinstance(getattr(options, flag), bool):
            raise ValueError(f"{flag} must be True or False, got {getattr(options, flag)!r}")


class StrategyOptions:
    """Base of the option classes; `name` is the strategy they configure."""

    name = "base"

    def describe(self) -> str:
        """'p3 slice_size=262144 credit=8': compared across ranks when wrapping."""
        return " ".join([self.name] + [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)])


@dataclass(frozen=True)
class AllreduceOptions(StrategyOptions):
    """One fused allreduce per dtype once backward is over.

    algorithm: "auto", "ring", "doubling" or "hierarchical" (mpicomm.algorithms;
    None: $MPITRAIN_ALLREDUCE, else auto: by size, nodes and ranks per node).
    node_window: True, the hierarchical allreduce's steps inside a node
    through an MPI-3 shared window (mpicomm.node_stage); False, as MPI messages;
    "auto" (the default), the window where MPI has no single-copy path for a
    node's large messages (mpicomm.single_copy; benchmarks/topology.md).
    """

    algorithm: str | None = None
    node_window: bool | str = AUTO
    name = "allreduce"

    def __post_init__(self):
        _check_algorithm(self.algorithm)
        _check_node_window(self.node_window)


@dataclass(frozen=True)
class WfbpOptions(StrategyOptions):
    """Wait-free backprop: each bucket's allreduce starts as soon as backward has produced it.

    fuse_bytes: gradients smaller than this share buckets of about this size; "auto" (the default): the
    smallest of 1, 2, 4 ... 64 MiB whose allreduce the cost model, told the measured link, sees spending at
    least 95 % of its time on bytes rather than per-step latencies, and at most 1/8 of the gradient
    (mpicomm.algorithms.CostModel.fuse_size): 1 MiB on a few nodes over a slow link, larger on many nodes or
    a fast one. Settled when wrapping, the same on every rank.
    algorithm: each bucket's allreduce, as AllreduceOptions' (auto picks per bucket size).
    in_flight: at most this many buckets' allreduces under way at once (1, the default: one after another, as
    DDP's and Horovod's queues run them), started in bucket order on every rank, the next the moment one ends;
    None: each the moment backward has produced it. On 8 emulated hosts at 1 Gbit/s all at once made every ring
    share the link and the two cores with 30 others, the first buckets finished last, and the step took 1.18-1.27x
    as long (benchmarks/claims.md, twenty-first pass).
    node_window: as AllreduceOptions'.
    """

    fuse_bytes: int | str = AUTO
    algorithm: str | None = None
    in_flight: int | None = 1
    node_window: bool | str = AUTO
    name = "wfbp"

    def __post_init__(self):
        _check_auto_or_int("fuse_bytes", self.fuse_bytes, 1)
        _check_algorithm(self.algorithm)
        if self.in_flight is not None:
            _check_int("in_flight", self.in_flight, 1)
        _check_node_window(self.node_window)


@dataclass(frozen=True)
class P3Options(StrategyOptions):
    """P3: slices of slice_size elements by forward-pass priority, at most credit messages in flight.

    Either may be "auto" (the default): chosen from the link measured when
    wrapping, so that fast links get fewer, larger messages (runtime.p3.tuning).
    credit="online": auto's first, then a few credits tried in turn over the
    first ~30 steps and the fastest kept, the same on every rank
    (runtime.p3.online_credit; like Horovod's autotune, opt-in).
    node_aggregation: on several nodes of several ranks, each slice is summed
    inside its node first and crosses the node's link once each way
    (mpicomm.sliced_ps); False: every rank pushes its own (the flat exchange).
    node_pacing: with node_aggregation and a measured link, the pushes inside a
    node go one at a time at a paced rate (runtime.p3.tuning.LOCAL_PACE);
    False: as fast as the queue lets them.
    node_window: with node_aggregation, those pushes and results go through
    an MPI-3 shared window (mpicomm.node_window: zero-byte notices, no pacing),
    where without it a node's messages starve its link when MPI has no
    single-copy path (benchmarks/topology.md); False: as MPI messages.
    yield_link: where module buffers are averaged by MPI's allreduce after each
    step (p3 carries them in its own exchange unless one is only watched:
    runtime.model_buffers), send nothing
    new from step() until the step's agreement and that average are done
    (mpicomm.sliced_ps's hold): their bytes, which the next forward waits for,
    then cross a link that is draining, not behind `credit` slices at each of
    their steps. Off by default: on the emulated 4 hosts it gained 2 % at
    most and nothing beyond the rounds' spread with 2 ranks a host; the
    simulator gives it 4-10 % at 128 nodes x 8 (benchmarks/claims.md).
    """

    slice_size: int | str = AUTO
    credit: int | str = AUTO
    node_aggregation: bool = True
    node_pacing: bool = True
    node_window: bool = True
    yield_link: bool = False
    name = "p3"

    def __post_init__(self):
        _check_auto_or_int("slice_size", self.slice_size, 1)
        _check_credit(self.credit)
        _check_flags(self, "node_aggregation", "node_pacing", "node_window", "yield_link")


@dataclass(frozen=True)
class TopkOptions(StrategyOptions):
    """Top-k sparsification with error feedback, flat (`topk`) or hierarchical (`hier-topk`).

    density: fraction of entries sent each step; error_feedback: keep what was
    not sent for later steps; warmup_steps dense steps first, then a DGC-style
    exponential ramp from 0.25 to density over ramp_steps; granularity
    "model" (select over the flattened model) or "layer" (k per parameter);
    operator "mstopk" (approximate, no sort) or "exact" (torch.topk);
    momentum_correction: move an SGD's momentum into the sparsifier (DGC), and
    momentum_masking: clear the velocity where entries were applied.
    """

    density: float = 0.01
    hierarchical: bool = False
    error_feedback: bool = True
    warmup_steps: int = 0
    ramp_steps: int = 0
    granularity: str = "model"
    operator: str = "mstopk"
    momentum_correction: bool = True
    momentum_masking: bool = True

    def __post_init__(self):
        _check_fraction("density", self.density)
        _check_int("warmup_steps", self.warmup_steps, 0)
        _check_int("ramp_steps", self.ramp_steps, 0)
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.operator not in OPERATORS:
            raise ValueError(f"operator must be one of {OPERATORS}, got {self.operator!r}")
        _check_flags(self, "hierarchical", "error_feedback", "momentum_correction", "momentum_masking")

    @property
    def name(self) -> str:  # type: ignore[override]
        return "hier-topk" if self.hierarchical else "topk"


@dataclass(frozen=True)
class HybCommOptions(StrategyOptions):
    """Poseidon's hybrid communication: each eligible Linear layer by sufficient factors or by the dense path.

    dense: "wfbp" or "p3" for every other gradient; force: "auto" (the cost
    model of runtime.hybrid.cost_model decides per layer and batch size),
    "sfb" (every eligible Linear by factors) or "ps" (none: a Linear chosen
    for PS goes through its own ring allreduce the moment its gradient is
    ready); bandwidth: a node's link in bit/s (None: $MPITRAIN_LINK_BANDWIDTH
    or 10 Gbit/s); intra_bandwidth: between ranks of one node; gflops: one
    rank's GEMM rate for the factor products (None: measured when wrapping,
    the slowest rank's). fuse_bytes (wfbp: bytes, a fixed 1 MiB by default;
    wfbp's "auto" is not taken here), slice_size and credit (p3, "auto" as
    P3Options') go to the dense path.
    """

    dense: str = "wfbp"
    force: str = "auto"
    bandwidth: float | None = None
    intra_bandwidth: float = DEFAULT_INTRA_BANDWIDTH
    gflops: float | None = None
    fuse_bytes: int = DEFAULT_FUSE_BYTES
    slice_size: int | str = AUTO
    credit: int | str = AUTO
    name = "hybcomm"

    def __post_init__(self):
        if self.dense not in HYBCOMM_DENSE:
            raise ValueError(f"dense must be one of {HYBCOMM_DENSE}, got {self.dense!r}")
        if self.force not in HYBCOMM_FORCE:
            raise ValueError(f"force must be one of {HYBCOMM_FORCE}, got {self.force!r}")
        for rate in ("bandwidth", "intra_bandwidth", "gflops"):
            value = getattr(self, rate)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or
                                      not value > 0 or value == float("inf")):
                raise ValueError(f"{rate} must be a positive finite number, got {value!r}")
        _check_int("fuse_bytes", self.fuse_bytes, 1)
        _check_auto_or_int("slice_size", self.slice_size, 1)
        _check_credit(self.credit)

    def dense_options(self) -> StrategyOptions:
        """The options of the dense path's own strategy."""
        if self.dense == "p3":
            return P3Options(slice_size=self.slice_size, credit=self.credit)
        return WfbpOptions(fuse_bytes=self.fuse_bytes)


OPTIONS = {"allreduce": AllreduceOptions, "wfbp": WfbpOptions, "p3": P3Options, "topk": TopkOptions,
           "hier-topk": lambda: TopkOptions(hierarchical=True), "hybcomm": HybCommOptions}


def resolve(strategy) -> StrategyOptions:
    """A strategy name (defaults) or an options object, as an options object."""
    if isinstance(strategy, StrategyOptions):
        return strategy
    if isinstance(strategy, str) and strategy in OPTIONS:
        return OPTIONS[strategy]()
    raise ValueError(f"unknown strategy {strategy!r}: pass one of {', '.join(OPTIONS)} or an options object "
                     "(AllreduceOptions, WfbpOptions, P3Options, TopkOptions, HybCommOptions)")
