"""Wait-free backprop starts averaging buckets while backward still runs; the fused allreduce waits for its end."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from dp_helpers import cross_entropy, sgd
from runtime import AllreduceOptions, DistributedOptimizer, WfbpOptions
from runtime.trace import Timeline, instrument

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:Full backward hook is firing")]  # the first layer's, expected

STEPS = 3


def model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 10))


def traced_steps(world, options):
    """Train STEPS steps with every layer instrumented; per step, this rank's spans that started in it."""
    rank = world.Get_rank()
    tl = Timeline(rank)
    net = model()
    handles = instrument(net, tl)
    dopt = DistributedOptimizer(sgd(net), net, options, timeline=tl)
    g = torch.Generator().manual_seed(rank)
    for k in range(STEPS):
        with tl.span(f"step {k}", "step"):
            dopt.zero_grad()
            cross_entropy(net(torch.randn(16, 32, generator=g)), torch.randint(0, 10, (16,), generator=g)).backward()
            dopt.step()
    dopt.close()
    for h in handles:
        h.remove()
    events = [e for e in tl.to_trace()["traceEvents"] if e["ph"] == "X"]
    steps = sorted((e for e in events if e["name"].startswith("step ")), key=lambda e: e["ts"])
    return [[e for e in events if s["ts"] <= e["ts"] <= s["ts"] + s["dur"] and e is not s] for s in steps]


def spans(step, prefix):
    return [e for e in step if e["name"].startswith(prefix)]


def overlap_problem(steps) -> str:
    """Why some step has no allreduce that started before its backward ended, or ''."""
    problems = []
    for k, step in enumerate(steps):
        backward, allreduce = spans(step, "backward "), spans(step, "allreduce ")
        if not backward or not allreduce:
            problems.append(f"step {k}: {len(backward)} backward and {len(allreduce)} allreduce spans")
            continue
        end = max(e["ts"] + e["dur"] for e in backward)
        first = min(allreduce, key=lambda e: e["ts"])
        if first["ts"] >= end:
            problems.append(f"step {k}: first allreduce ({first['name']}) starts {first['ts'] - end:.1f} us after "
                            "backward ended")
    return "; ".join(problems)


def test_wfbp_starts_allreduces_before_backward_ends(world):
    """In every step the last layer's bucket is on the wire while earlier layers still run backward.

    Catches a wfbp that only queues buckets and starts them from step() (an allreduce in disguise): its
    first allreduce would start after the last backward span, as the contrast below shows for allreduce.
    """
    steps = traced_steps(world, WfbpOptions(fuse_bytes=1024))  # about one bucket per parameter
    assert_everywhere(world, len(steps) == STEPS, f"{len(steps)} step spans")
    problem = overlap_problem(steps)
    assert_everywhere(world, not problem, problem)
    buckets = {e["name"] for step in steps for e in spans(step, "allreduce b")}
    assert_everywhere(world, len(buckets) >= 4, f"buckets {sorted(buckets)}: fuse_bytes did not split them")


def test_fused_allreduce_starts_only_after_backward_ended(world):
    """The contrast: the same check rejects the allreduce strategy in every step, so it can tell the two apart."""
    steps = traced_steps(world, AllreduceOptions())
    assert_everywhere(world, len(steps) == STEPS, f"{len(steps)} step spans")
    problem = overlap_problem(steps)
    assert_everywhere(world, problem.count("after backward ended") == STEPS, problem or "allreduce overlapped")
    for step in steps:
        end = max(e["ts"] + e["dur"] for e in spans(step, "backward "))
        assert_everywhere(world, [e["name"] for e in spans(step, "allreduce ")] == ["allreduce (fused)"],
                          str([e["name"] for e in spans(step, "allreduce ")]))
        assert_everywhere(world, spans(step, "allreduce ")[0]["ts"] >= end, "fused allreduce before backward end")
