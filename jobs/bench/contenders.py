"""What each contender name of jobs.bench.strategies_worker stands for: runtime options, p3 variants, forced hybcomm."""

from __future__ import annotations

from jobs.common.choices import EXACT_STRATEGIES, P3_CREDIT_WORDS
from jobs.common.choices import SPARSE_STRATEGIES as SPARSE
from jobs.common.inputs import InputError, at_least, auto_or_count, comma_list, fraction

# hybcomm with every eligible layer forced to sufficient factors or to the parameter-server path.
FORCED = {"hybcomm-sfb": "sfb", "hybcomm-ps": "ps"}
STRATEGIES = (*EXACT_STRATEGIES, *FORCED, "p3-flat", "p3-messages", "p3-unpaced", "p3-yield", "ddp", *SPARSE,
              "allreduce-messages", "allreduce-window", "wfbp-messages", "wfbp-window")
DENSE_WITH_ALGORITHM = ("allreduce", "wfbp")  # "wfbp@hierarchical": its allreduce's algorithm (mpicomm.algorithms)


def check_settings(args) -> list[str]:
    """The strategies to run, after checking what jobs.bench hands the worker under the same option names."""
    strategies = comma_list("--strategies", args.strategies)
    for s in strategies:
        if s.startswith("wfbp/"):
            wfbp_window(s.removesuffix("+pto"))
        elif s.startswith("p3@"):
            check_p3_variant(s.removesuffix("+pto"))
        elif "@" in s and s.partition("@")[0] in DENSE_WITH_ALGORITHM:
            check_algorithm_variant(s.removesuffix("+pto"))
        elif s.removesuffix("+pto") not in STRATEGIES or s == "ddp+pto":
            raise InputError("--strategies", f"unknown {s!r} (choose from {', '.join(STRATEGIES)}; "
                                             "any but ddp may end in +pto)")
    at_least(args, 1, "batch_size", "batches", "iters", "rounds", "threads")
    auto_or_count(args, "slice_size")
    auto_or_count(args, "credit", words=P3_CREDIT_WORDS)
    at_least(args, 0, "warmup")
    fraction(args, "density")
    return strategies


def p3_settings(name: str, args) -> tuple:
    """(slice_size, credit) of "p3" (--slice-size, --credit) or of a variant "p3@SLICE/CREDIT" (each auto or a
    count; the credit may be online)."""
    if name == "p3":
        return args.slice_size, args.credit
    slice_size, _, credit = name.removeprefix("p3@").partition("/")
    return tuple(v if v in P3_CREDIT_WORDS else int(v) for v in (slice_size, credit))


def check_p3_variant(name: str) -> None:
    """'p3@65536/4', 'p3@auto/8', 'p3@auto/online': the variant's two settings, or an error naming it."""
    slice_size, sep, credit = name.removeprefix("p3@").partition("/")
    count = lambda v: v.isdigit() and int(v) >= 1  # noqa: E731
    if not sep or not (slice_size == "auto" or count(slice_size)) or \
            not (credit in P3_CREDIT_WORDS or count(credit)):
        raise InputError("--strategies", f"bad p3 variant {name!r}: write p3@SLICE/CREDIT, each auto or a "
                                         "whole number >= 1, the credit also online (e.g. p3@262144/8, "
                                         "p3@auto/4, p3@auto/online)")


def wfbp_window(name: str) -> int | None:
    """'wfbp/2' -> 2, 'wfbp/all' -> None: wfbp's in_flight (buckets' allreduces under way), or an error naming it."""
    window = name.removeprefix("wfbp/")
    if window == "all":
        return None
    if not (window.isdigit() and int(window) >= 1):
        raise InputError("--strategies", f"bad wfbp variant {name!r}: write wfbp/N (N >= 1 buckets under way at "
                                         "once) or wfbp/all")
    return int(window)


def check_algorithm_variant(name: str) -> None:
    """'wfbp@hierarchical', 'allreduce@ring': a dense strategy whose allreduce takes one algorithm."""
    from mpicomm.algorithms import CHOICES

    if name.partition("@")[2] not in CHOICES:
        raise InputError("--strategies", f"bad variant {name!r}: write STRATEGY@ALGORITHM with the algorithm one "
                                         f"of {', '.join(CHOICES)} (e.g. wfbp@hierarchical, allreduce@ring)")


def hybcomm_options(args, force: str):
    """hybcomm's options: the cost model is told the rate of the links it runs on (the --bandwidth label)."""
    from mpicomm.emulation import EmulationError, parse_bandwidth
    from runtime.options import HybCommOptions

    try:
        bps = parse_bandwidth(args.bandwidth)  # unshaped: None, the cost model's default
    except EmulationError:  # a label such as local-unshaped
        bps = None
    return HybCommOptions(force=force, bandwidth=bps, slice_size=args.slice_size, credit=args.credit)


def strategy_options(base: str, args):
    """The runtime options (or name) a contender without its "+pto" suffix stands for."""
    from runtime import AllreduceOptions, P3Options, TopkOptions, WfbpOptions

    if base.startswith("wfbp/"):
        return WfbpOptions(in_flight=wfbp_window(base))
    name, _, algorithm = base.partition("@")
    if algorithm and name in DENSE_WITH_ALGORITHM:
        if name == "wfbp":
            return WfbpOptions(algorithm=algorithm)
        return AllreduceOptions(algorithm=algorithm)
    if base.endswith(("-messages", "-window")) and base.partition("-")[0] in DENSE_WITH_ALGORITHM:
        # the hierarchy's node steps as messages or through the shared window, whatever MPI's single copy
        name, _, how = base.partition("-")
        return (AllreduceOptions if name == "allreduce" else WfbpOptions)(node_window=how == "window")
    if base == "p3-flat":  # p3 without node-local aggregation: every rank pushes its own slices across
        return P3Options(args.slice_size, args.credit, node_aggregation=False)
    if base == "p3-messages":  # p3 whose pushes inside a node are MPI messages (paced), not the shared window
        return P3Options(args.slice_size, args.credit, node_window=False)
    if base == "p3-unpaced":  # the same, as fast as the queue lets them
        return P3Options(args.slice_size, args.credit, node_window=False, node_pacing=False)
    if base == "p3-yield":  # p3 that holds its sends while the step's agreement and buffers' average cross
        return P3Options(args.slice_size, args.credit, yield_link=True)
    if base.startswith("p3"):
        return P3Options(*p3_settings(base, args))
    if base in SPARSE:
        return TopkOptions(density=args.density, hierarchical=base == "hier-topk")
    if base == "hybcomm" or base in FORCED:
        return hybcomm_options(args, FORCED.get(base, "auto"))
    return base
