"""P3 sends slices by priority, not in hand-over order, with at most `credit` messages in flight."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from dp_helpers import cross_entropy, sgd
from mpicomm import sliced_ps
from mpicomm.sliced_ps import SlicedExchange
from runtime import DistributedOptimizer, P3Options
from runtime.trace import Timeline

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

# Four tensors, each its own flat buffer, cut into 3-element slices (13 slices, owners round-robin).
SIZES, SLICE = [10, 7, 12, 5], 3
PRIORITY = [3, 1, 0, 2]  # not the tensor order: a queue sorted by slice index would also fail
BACKWARD = sorted(range(len(SIZES)), key=lambda t: -PRIORITY[t])  # least urgent first: [0, 3, 1, 2]

# The queue of a FIFO exchange: what a P3 without priorities would do.
FIFO = types.SimpleNamespace(heappush=lambda queue, item: queue.append(item), heappop=lambda queue: queue.pop(0))


def exchange(world, credit, timeline, sizes=SIZES):
    """A SlicedExchange over one flat buffer per tensor, with the priorities above; polled by the test itself."""
    buffers = [torch.zeros(n) for n in sizes]
    ex = SlicedExchange(world, buffers, [(t, 0, n) for t, n in enumerate(sizes)], SLICE, credit=credit,
                        timeline=timeline)
    ex.set_priorities(PRIORITY)
    return ex, buffers


def fill(buffers, rank):
    """base + rank, base distinct per element and tensor: the average over ranks is base + (P-1)/2."""
    for t, buf in enumerate(buffers):
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32) + 100 * t + rank)


def averaged(buffers, size) -> bool:
    return all(torch.equal(buf, torch.arange(buf.numel(), dtype=torch.float32) + 100 * t + (size - 1) / 2)
               for t, buf in enumerate(buffers))


def poll_to_the_end(ex):
    """Poll from this thread until the step is over; the most outgoing requests seen after any poll."""
    most = 0
    while True:
        finished = ex.poll()
        most = max(most, ex.outgoing)
        if finished:
            return most


def pushes(trace, after=None):
    """This rank's pushes by start: (priority, slice), optionally only those started after an instant."""
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    start = min((e["ts"] for e in events if e["name"] == after), default=None) if after else None
    return [(e["args"]["priority"], e["args"]["slice"]) for e in sorted(events, key=lambda e: e["ts"])
            if e["name"].startswith("push s") and (start is None or e["ts"] >= start)]


def order_problem(sent) -> str:
    """Why these pushes are not in priority order (most urgent first, then by slice), or ''."""
    return "" if sent == sorted(sent) else f"pushes (priority, slice) in order {sent}"


def most_in_flight(trace) -> int:
    """The most outgoing messages (push and send-result spans) open at one time on this rank."""
    marks = []
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["name"].startswith(("push s", "send result s")):
            marks += [(e["ts"], 1), (e["ts"] + e["dur"] - 0.01, -1)]  # 0.01 us: the trace's rounding
    level = most = 0
    for _, step in sorted(marks, key=lambda m: (m[0], m[1])):
        level += step
        most = max(most, level)
    return most


def step_in_backward_order(world, credit):
    """One exchange step: every tensor handed over, least urgent first, before the first poll."""
    rank, size = world.Get_rank(), world.Get_size()
    tl = Timeline(rank)
    ex, buffers = exchange(world, credit, tl)
    try:
        fill(buffers, rank)
        ex.begin()
        for t in BACKWARD:
            ex.ready(t)
        most = poll_to_the_end(ex)
        ours = sum(1 for s in range(ex.plan.count) if ex.plan.owner(s) != rank)  # slices this rank pushes
        return tl.to_trace(), most, averaged(buffers, size) and all(ex.tensor_done), ours
    finally:
        ex.free()


@pytest.mark.parametrize("credit", [1, 3])
def test_pushes_go_out_most_urgent_first_within_credit(world, credit):
    """Handed over least urgent first (as backward does), the slices still leave most urgent first.

    Also: never more than `credit` outgoing messages (after a poll, or by the timeline's spans), and the
    step leaves every tensor holding the average over ranks.
    """
    trace, most, ok, ours = step_in_backward_order(world, credit)
    sent = pushes(trace)
    problem = order_problem(sent)
    assert_everywhere(world, not problem, problem)
    assert_everywhere(world, len(sent) == ours, f"{len(sent)} pushes recorded, {ours} slices to push")
    assert_everywhere(world, most <= credit, f"{most} outgoing requests after a poll, credit {credit}")
    assert_everywhere(world, most_in_flight(trace) <= credit, f"{most_in_flight(trace)} messages in flight")
    assert_everywhere(world, ok, "not every tensor holds the average over ranks")


def test_a_fifo_exchange_fails_the_order_check(world, monkeypatch):
    """The same step with a queue that ignores priority: it averages correctly, but the order check rejects it.

    This is the check of the test above failing on the implementation it exists to catch.
    """
    monkeypatch.setattr(sliced_ps, "heapq", FIFO)
    trace, most, ok, _ = step_in_backward_order(world, credit=1)
    problem = order_problem(pushes(trace))
    assert_everywhere(world, ok, "the FIFO variant did not average")
    assert_everywhere(world, bool(problem), "the order check passed a FIFO exchange")
    assert_everywhere(world, [p for p, _ in pushes(trace)][0] == max(PRIORITY),
                      "FIFO did not send the least urgent tensor first")


def test_a_slice_handed_over_later_overtakes_queued_ones(world):
    """Less urgent tensors are queued and partly sent; then the most urgent one arrives and goes next."""
    rank, size = world.Get_rank(), world.Get_size()
    tl = Timeline(rank)
    sizes = [30, 30, 3, 30]  # tensors 0, 1 and 3: 10 slices each, tensor 2 (priority 0): one
    ex, buffers = exchange(world, 1, tl, sizes)
    try:
        fill(buffers, rank)
        ex.begin()
        for t in (0, 3, 1):
            ex.ready(t)
        ex.poll()  # sends at most 2 of this rank's >= 20 queued pushes (credit 1)
        tl.instant("urgent", "test")
        ex.ready(2)
        poll_to_the_end(ex)
        later = pushes(tl.to_trace(), after="urgent")
        owner_of_urgent = ex.plan.owner(ex.plan.slices_of[2][0])
        first = later[0][0] if later else None
        want = 0 if rank != owner_of_urgent else 1  # the owner does not push its own slice
        assert_everywhere(world, first == want, f"first push after the urgent tensor arrived: {later[:3]}")
        assert_everywhere(world, not order_problem(later), order_problem(later))
        assert_everywhere(world, averaged(buffers, size), "not averaged")
    finally:
        ex.free()


# End to end: a small first layer (one tensor, slices of its own) and larger later layers.
SLICE_E2E, STEPS = 16, 3


def model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 32, bias=False), nn.Tanh(), nn.Linear(32, 64), nn.Tanh(),
                         nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def train_traced(world):
    """A few p3 steps at credit 1; per step, this rank's pushes by start as (is a first-layer slice) flags."""
    rank = world.Get_rank()
    tl = Timeline(rank)
    net = model()
    # The flat exchange, whatever the layout: with node-local aggregation a cross push waits for the node's
    # pushes too, so a step's pushes are not one run per rank (tests/test_p3_nodes_mpi.py covers that exchange).
    dopt = DistributedOptimizer(sgd(net), net, P3Options(slice_size=SLICE_E2E, credit=1, node_aggregation=False),
                                timeline=tl)
    plan = dopt.strategy.exchange.plan
    g = torch.Generator().manual_seed(11 + rank)
    for k in range(STEPS):
        with tl.span(f"step {k}", "step"):  # recorded while step 0's pushes are in flight
            dopt.zero_grad()
            cross_entropy(net(torch.randn(16, 8, generator=g)), torch.randint(0, 4, (16,), generator=g)).backward()
            dopt.step()
    dopt.close()
    first_layer = set(plan.slices_of[0])
    alone = all(plan.tensors_of[s] == [0] for s in first_layer)  # no slice shared with the next layer
    ours = [s for s in range(plan.count) if plan.owner(s) != rank]
    sent = [s for _, s in pushes(tl.to_trace())]
    steps = [sent[k * len(ours):(k + 1) * len(ours)] for k in range(STEPS)]  # steps never overlap
    return [[s in first_layer for s in step] for step in steps], alone and len(sent) == STEPS * len(ours)


def first_layer_problem(steps) -> str:
    """The first layer's pushes must go in one run, ahead of later layers' pushes still queued."""
    problems = []
    for k, flags in enumerate(steps):
        at = [i for i, f in enumerate(flags) if f]
        if not at:
            problems.append(f"step {k}: no first-layer push")
        elif at != list(range(at[0], at[-1] + 1)):
            problems.append(f"step {k}: first-layer pushes interleaved at positions {at}")
        elif at[-1] == len(flags) - 1:
            problems.append(f"step {k}: first-layer pushes last of {len(flags)}, behind every later layer")
    return "; ".join(problems)


def test_training_pushes_the_first_layer_ahead_of_later_layers(world):
    """Backward produces the first layer's gradient last; p3 sends it before the later layers' slices that
    are still queued, in every step (a FIFO would send it last; its run is checked below)."""
    steps, complete = train_traced(world)
    assert_everywhere(world, complete, "first-layer slices shared, or not every slice pushed once a step")
    problem = first_layer_problem(steps)
    assert_everywhere(world, not problem, problem)


def test_training_with_a_fifo_exchange_fails_the_first_layer_check(world, monkeypatch):
    monkeypatch.setattr(sliced_ps, "heapq", FIFO)
    steps, complete = train_traced(world)
    assert_everywhere(world, complete, "first-layer slices shared, or not every slice pushed once a step")
    assert_everywhere(world, "behind every later layer" in first_layer_problem(steps),
                      "the first-layer check passed a FIFO exchange")
