"""Typed strategy options: defaults, names, describe(), validation messages, resolve(), and early refusals."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from mpi4py import MPI

from runtime import (AUTO, DEFAULT_FUSE_BYTES, AllreduceOptions, DistributedOptimizer, HybCommOptions,
                     P3Options, StrategyOptions, TopkOptions, WfbpOptions)
from runtime.options import OPTIONS, resolve
from runtime.registry import strategy_class

NAN = float("nan")


def test_defaults():
    assert (DEFAULT_FUSE_BYTES, AUTO) == (1 << 20, "auto")
    assert WfbpOptions().fuse_bytes == AUTO and WfbpOptions(fuse_bytes=DEFAULT_FUSE_BYTES).fuse_bytes == 1 << 20
    assert (P3Options().slice_size, P3Options().credit) == (AUTO, AUTO)  # chosen from the measured link
    assert (HybCommOptions().slice_size, HybCommOptions().credit) == (AUTO, AUTO)
    assert dataclasses.asdict(TopkOptions()) == dict(
        density=0.01, hierarchical=False, error_feedback=True, warmup_steps=0, ramp_steps=0, granularity="model",
        operator="mstopk", momentum_correction=True, momentum_masking=True)
    # None: $MPITRAIN_ALLREDUCE, else auto (mpicomm.algorithms); p3 aggregates inside nodes unless told not to.
    assert AllreduceOptions().algorithm is None and WfbpOptions().algorithm is None
    assert P3Options().node_aggregation is True and P3Options().node_pacing is True and P3Options().yield_link is False
    with pytest.raises(ValueError, match="algorithm must be one of"):
        WfbpOptions(algorithm="tree")
    with pytest.raises(ValueError, match="node_aggregation must be True or False"):
        P3Options(node_aggregation="yes")
    with pytest.raises(ValueError, match="node_pacing must be True or False"):
        P3Options(node_pacing=1)
    with pytest.raises(ValueError, match="yield_link must be True or False"):
        P3Options(yield_link=None)


@pytest.mark.parametrize("options, name", [
    (AllreduceOptions(), "allreduce"), (WfbpOptions(), "wfbp"), (P3Options(), "p3"), (TopkOptions(), "topk"),
    (TopkOptions(hierarchical=True), "hier-topk"),
])
def test_each_options_object_names_a_registered_strategy(options, name):
    """The name selects the strategy class: a wrong one would run another strategy than the options describe."""
    assert options.name == name
    assert strategy_class(name).name == name


def test_describe_names_the_strategy_and_every_field():
    assert AllreduceOptions().describe() == "allreduce algorithm=None node_window='auto'"
    assert WfbpOptions(algorithm="hierarchical").describe() == \
        "wfbp fuse_bytes='auto' algorithm='hierarchical' in_flight=1 node_window='auto'"
    assert P3Options(slice_size=1000, credit=2).describe() == \
        "p3 slice_size=1000 credit=2 node_aggregation=True node_pacing=True node_window=True yield_link=False"
    assert TopkOptions(hierarchical=True).describe() == (
        "hier-topk density=0.01 hierarchical=True error_feedback=True warmup_steps=0 ramp_steps=0 "
        "granularity='model' operator='mstopk' momentum_correction=True momentum_masking=True")


@pytest.mark.parametrize("field, other", [
    ("density", 0.5), ("hierarchical", True), ("error_feedback", False), ("warmup_steps", 3), ("ramp_steps", 7),
    ("granularity", "layer"), ("operator", "exact"), ("momentum_correction", False), ("momentum_masking", False),
])
def test_describe_tells_apart_options_that_differ_in_any_field(field, other):
    """Ranks compare describe() when wrapping: a field it left out could differ between ranks unnoticed."""
    assert TopkOptions(**{field: other}).describe() != TopkOptions().describe()


BAD = [
    (P3Options, "slice_size", 0), (P3Options, "slice_size", -1), (P3Options, "slice_size", 1.5),
    (P3Options, "slice_size", True), (P3Options, "slice_size", "8"), (P3Options, "slice_size", None),
    (P3Options, "slice_size", "Auto"), (HybCommOptions, "credit", "automatic"),
    (P3Options, "credit", 0), (P3Options, "credit", -2), (P3Options, "credit", 2.0), (P3Options, "credit", True),
    (P3Options, "credit", "Online"), (P3Options, "credit", "tune"),
    (WfbpOptions, "fuse_bytes", 0), (WfbpOptions, "fuse_bytes", -1), (WfbpOptions, "fuse_bytes", 1.5),
    (WfbpOptions, "fuse_bytes", False), (WfbpOptions, "fuse_bytes", "big"),
    (WfbpOptions, "in_flight", 0), (WfbpOptions, "in_flight", 1.0), (WfbpOptions, "in_flight", True),
    (WfbpOptions, "in_flight", "auto"), (WfbpOptions, "node_window", 1), (AllreduceOptions, "node_window", None),
    (AllreduceOptions, "node_window", "Auto"),
    (TopkOptions, "density", 0), (TopkOptions, "density", 1.5), (TopkOptions, "density", NAN),
    (TopkOptions, "density", -0.1), (TopkOptions, "density", math.inf), (TopkOptions, "density", True),
    (TopkOptions, "density", "0.1"),
    (TopkOptions, "warmup_steps", -1), (TopkOptions, "warmup_steps", 2.0), (TopkOptions, "warmup_steps", True),
    (TopkOptions, "ramp_steps", -1),
    (TopkOptions, "granularity", "block"), (TopkOptions, "granularity", "Model"),
    (TopkOptions, "operator", "sort"), (TopkOptions, "operator", None),
    (TopkOptions, "hierarchical", 1), (TopkOptions, "hierarchical", "yes"), (TopkOptions, "error_feedback", 0),
    (TopkOptions, "momentum_correction", 1), (TopkOptions, "momentum_masking", None),
]


@pytest.mark.parametrize("cls, field, value", BAD, ids=[f"{c.__name__}.{f}={v!r}" for c, f, v in BAD])
def test_every_validation_error_names_the_field_and_the_bad_value(cls, field, value):
    """The message starts with the field and ends with the value as given (repr: '8' is not 8, True not 1)."""
    with pytest.raises(ValueError, match=rf"^{field} must .*, got {re.escape(repr(value))}$"):
        cls(**{field: value})


EDGES = [
    (P3Options, dict(slice_size=1, credit=1)), (P3Options, dict(credit="online")),
    (HybCommOptions, dict(credit="online")), (WfbpOptions, dict(fuse_bytes=1)), (TopkOptions, dict(density=1)),
    (TopkOptions, dict(density=1e-9)),
    (TopkOptions, dict(warmup_steps=0, ramp_steps=0, granularity="layer", operator="exact", hierarchical=True,
                       error_feedback=False, momentum_correction=False, momentum_masking=False)),
]


@pytest.mark.parametrize("cls, kwargs", EDGES,
                         ids=[f"{c.__name__}(" + ", ".join(f"{f}={v!r}" for f, v in k.items()) + ")" for c, k in EDGES])
def test_the_edges_of_each_range_are_accepted(cls, kwargs):
    """Built inside the test (a refusal fails it), and every field keeps the value given: not clamped, not
    replaced by a default."""
    options = cls(**kwargs)
    assert {field: getattr(options, field) for field in kwargs} == kwargs


def test_options_are_frozen_values():
    """Frozen: options cannot change after the ranks compared them; equal settings compare and hash equal."""
    p3 = P3Options(slice_size=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p3.credit = 1
    assert p3 == P3Options(slice_size=5) != P3Options(slice_size=6)
    assert len({p3, P3Options(slice_size=5)}) == 1


@pytest.mark.parametrize("name", list(OPTIONS))
def test_resolve_turns_a_name_into_its_default_options(name):
    options = resolve(name)
    assert isinstance(options, StrategyOptions) and options.name == name
    assert options == {"hier-topk": TopkOptions(hierarchical=True)}.get(name, type(options)())


def test_resolve_passes_an_options_object_through():
    p3 = P3Options(slice_size=7, credit=1)
    assert resolve(p3) is p3


@pytest.mark.parametrize("bad", ["P3", "sgd", "", None, 3, P3Options])
def test_resolve_refuses_anything_else_naming_it_and_the_choices(bad):
    """A misspelt name (or the options class instead of an instance) must not fall back to a default strategy."""
    with pytest.raises(ValueError, match=rf"unknown strategy {re.escape(repr(bad))}: pass one of allreduce, wfbp, "
                                         r"p3, topk, hier-topk, hybcomm or an options object"):
        resolve(bad)


@dataclasses.dataclass(frozen=True)
class UnregisteredOptions(StrategyOptions):
    """Options of a strategy nobody registered (runtime.registry.register_strategy)."""

    name = "unregistered"


def wrap(strategy, comm, **kw):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        DistributedOptimizer(opt, model, strategy, comm=comm, **kw)
    finally:
        # Nothing was attached or changed: no hooks on the model, parameters and optimizer as they were.
        assert not model._forward_pre_hooks and not any(p._post_accumulate_grad_hooks for p in model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert opt.param_groups[0]["momentum"] == 0.9


REFUSED = [
    ("bogus", {}, "unknown strategy 'bogus'"),
    (UnregisteredOptions(), {}, "unknown strategy 'unregistered'"),
    ("p3", {"backward_passes_per_step": 0}, "backward_passes_per_step must be an integer >= 1, got 0"),
    ("p3", {"backward_passes_per_step": -1}, "backward_passes_per_step must be an integer >= 1, got -1"),
    ("p3", {"backward_passes_per_step": 1.5}, "backward_passes_per_step must be an integer >= 1, got 1.5"),
    ("p3", {"backward_passes_per_step": "2"}, "backward_passes_per_step must be an integer >= 1, got '2'"),
    ("p3", {"backward_passes_per_step": None}, "backward_passes_per_step must be an integer >= 1, got None"),
]
IDS = [f"{s!r}-{kw}" for s, kw, _ in REFUSED]


@pytest.mark.parametrize("strategy, kw, message", REFUSED, ids=IDS)
def test_distributed_optimizer_refuses_bad_settings_on_comm_self(strategy, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        wrap(strategy, MPI.COMM_SELF, **kw)


@pytest.mark.parametrize("strategy, kw, message", REFUSED, ids=IDS)
def test_distributed_optimizer_refuses_bad_settings_before_any_mpi_call(strategy, kw, message):
    """On the null communicator any MPI call fails (see below): a ValueError here was raised before the first.

    Catches a check made after the collective set-up (the Topology's duplicates), which would also leak those
    communicators on every rank, and on other ranks hang the collective if only one rank's settings were bad.
    """
    with pytest.raises(ValueError, match=re.escape(message)):
        wrap(strategy, MPI.COMM_NULL, **kw)


def test_the_null_communicator_does_fail_the_first_mpi_call():
    """The control for the test above: with good settings the wrapper reaches MPI and fails there."""
    with pytest.raises(MPI.Exception, match="communicator"):
        wrap("p3", MPI.COMM_NULL)


@pytest.mark.parametrize("field, value, message", [
    ("dense", "allreduce", r"dense must be one of \('wfbp', 'p3'\)"),
    ("force", "SFB", r"force must be one of \('auto', 'sfb', 'ps'\)"),
    ("bandwidth", 0, "bandwidth must be a positive finite number, got 0"),
    ("bandwidth", float("inf"), "bandwidth must be a positive finite number, got inf"),
    ("gflops", -1.0, "gflops must be a positive finite number"),
    ("intra_bandwidth", True, "intra_bandwidth must be a positive finite number, got True"),
    ("credit", 0, "credit must be 'auto', 'online' or an integer >= 1"),
])
def test_hybcomm_options_refuse_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        HybCommOptions(**{field: value})


def test_hybcomm_options_hand_the_dense_path_its_own():
    assert HybCommOptions(fuse_bytes=64).dense_options() == WfbpOptions(fuse_bytes=64)
    assert HybCommOptions(dense="p3", slice_size=9, credit=2).dense_options() == P3Options(slice_size=9, credit=2)
    assert resolve("hybcomm") == HybCommOptions()


def test_bench_worker_takes_the_dense_strategies_node_steps_either_way():
    """allreduce-messages, wfbp-window, ...: the hierarchy's node steps as MPI messages or through the shared
    window whatever MPI's single copy; plain names: the default (auto)."""
    from jobs.bench import contenders
    from jobs.bench import strategies_worker as bench_worker

    args = bench_worker.parse_args(["--model", "mlp", "--strategies",
                                    "allreduce,allreduce-messages,allreduce-window,wfbp,wfbp-messages,wfbp-window"])
    opts = [contenders.strategy_options(s, args) for s in args.strategies]
    assert opts[0] == "allreduce" and opts[3] == "wfbp"  # by name: the defaults
    assert [(o.name, o.node_window, o.algorithm) for o in opts[1:3] + opts[4:]] == [
        ("allreduce", False, None), ("allreduce", True, None), ("wfbp", False, None), ("wfbp", True, None)]
