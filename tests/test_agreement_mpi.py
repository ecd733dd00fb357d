"""Ranks that disagree or fail: a clear error on every rank, never a hang."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from dp_helpers import batches, local, wrap
from mpicomm.failstop import PeerFailedError
from mpicomm.requests import finish_abandoned, live_requests
from mpicomm.step_check import EXCHANGE, StepCheck
from runtime import StallPolicy

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def model_and_opt(lr=0.05):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(11, 13), nn.Tanh(), nn.Linear(13, 5))
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def one_step(world, model, dopt, step=0):
    X, Y = batches(world.Get_size(), steps=step + 1)
    r = world.Get_rank()
    dopt.zero_grad()
    nn.functional.cross_entropy(model(local(X[step], r)), local(Y[step], r)).backward()
    dopt.step()


def needs_two(world):
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")


def raised_everywhere(world, fn, *patterns):
    """fn() raises on every rank with a message matching every pattern (rank-independent)."""
    import re

    try:
        fn()
        message = None
    except Exception as exc:  # noqa: BLE001 - any error type, as long as it says what happened
        message = f"{type(exc).__name__}: {exc}"
    ok = message is not None and all(re.search(p, message) for p in patterns)
    assert_everywhere(world, ok, f"got {message!r}, wanted {patterns}")
    return message


@pytest.mark.parametrize("setting", ["strategy", "slice_size", "pto"])
def test_one_rank_configured_differently_is_named(world, setting):
    needs_two(world)
    odd = world.Get_rank() == 1
    model, opt = model_and_opt()
    kw = {"strategy": "wfbp" if odd else "p3"} if setting == "strategy" else {"strategy": "p3"}
    if setting == "slice_size":
        kw["slice_size"] = 5 if odd else 7
    if setting == "pto":
        kw["pto"] = odd
    strategy = kw.pop("strategy")
    raised_everywhere(world, lambda: wrap(opt, model, strategy, **kw), "rank 0", "rank 1", setting.split("_")[0])


def test_different_learning_rate_is_named_at_the_first_step(world):
    needs_two(world)
    model, opt = model_and_opt(lr=0.1 if world.Get_rank() == 1 else 0.05)
    dopt = wrap(opt, model, "allreduce")
    raised_everywhere(world, lambda: one_step(world, model, dopt), "lr", "0.1", "0.05", "rank 1")
    dopt.close()


@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "p3", "topk"])
def test_ranks_stepping_a_different_number_of_times(world, strategy):
    needs_two(world)
    model, opt = model_and_opt()
    dopt = wrap(opt, model, strategy)

    def run():
        for step in range(3 if world.Get_rank() == 1 else 4):
            one_step(world, model, dopt, step)
        dopt.close()
    raised_everywhere(world, run, "step", "rank 1", "close")
    dopt.close()  # after the error: releases what is left, without communicating


def test_p3_step_returns_before_a_late_rank_has_stepped_and_its_next_forward_agrees(world):
    """p3's step() leaves the agreement in flight (runtime.stepping): rank 0 returns from it while rank 1 has not
    stepped yet and waits for a word from rank 0 first. A step() that waited for the agreement would never send
    it (rank 0 then stops at the stall limit, rank 1 at its deadline). The parameters still equal one process's."""
    needs_two(world)
    model, opt = model_and_opt()
    dopt = wrap(opt, model, "p3", stall=StallPolicy(warn_after=None, timeout=10.0))
    side = world.Dup()
    word = torch.zeros(1, dtype=torch.int64).numpy()
    r = world.Get_rank()
    got = True
    for step in range(3):
        if step == 1 and r == 1:
            req = side.Irecv(word, source=0)
            deadline = time.monotonic() + 15
            while not req.Test() and time.monotonic() < deadline:
                time.sleep(1e-3)
            got = bool(word[0] == 7)
            if not got:
                req.Cancel()
                req.Wait()
        one_step(world, model, dopt, step)
        if step == 1 and r == 0:
            word[0] = 7
            side.Send(word, dest=1)
    dopt.close()
    side.Free()
    assert_everywhere(world, got, "rank 0's step() waited for rank 1")
    reference, ref_opt = model_and_opt()
    for step in range(3):
        X, Y = batches(world.Get_size(), steps=step + 1)  # as one_step draws them
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(X[step]), Y[step]).backward()
        ref_opt.step()
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), reference.parameters()))
    assert_everywhere(world, same, "p3 with its agreement in flight differs from one process")


def test_p3_next_forward_runs_before_the_steps_agreement_where_every_parameter_was_used(world):
    """Every parameter used on a rank: whatever the others used, every update is owed (the agreement ORs the
    flags), so p3's next forward runs with the step's agreement still in flight (runtime.stepping). Rank 1 steps
    only once rank 0 has run its next forward: a forward that waited for the agreement would wait for ever
    (rank 0 then stops at the stall limit, rank 1 at its deadline). The next step() finishes the agreement;
    the parameters still equal one process's."""
    needs_two(world)
    model, opt = model_and_opt()
    dopt = wrap(opt, model, "p3", stall=StallPolicy(warn_after=None, timeout=10.0))
    side, word, r = world.Dup(), np.zeros(1, dtype=np.int64), world.Get_rank()
    X, Y = batches(world.Get_size(), steps=2)
    got, pending = True, True
    for step in range(2):
        dopt.zero_grad()
        loss = nn.functional.cross_entropy(model(local(X[step], r)), local(Y[step], r))
        if step == 1 and r == 0:
            pending = dopt.check.pending  # the forward ran without it
            for peer in range(1, world.Get_size()):
                side.Send(word, dest=peer)
        loss.backward()
        if step == 0 and r != 0:
            req, deadline = side.Irecv(word, source=0), time.monotonic() + 15
            while not req.Test() and time.monotonic() < deadline:
                time.sleep(1e-3)
            got = bool(req.Test())
            if not got:
                req.Cancel()
                req.Wait()
        dopt.step()
    dopt.close()
    side.Free()
    assert_everywhere(world, got and pending, f"rank 0's forward waited for the agreement (word: {got}, "
                                              f"agreement still in flight at its forward: {pending})")
    reference, ref_opt = model_and_opt()
    for step in range(2):
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(X[step]), Y[step]).backward()
        ref_opt.step()
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), reference.parameters()))
    assert_everywhere(world, same, "p3 with its updates owed before the agreement differs from one process")


class BodyAndScale(nn.Module):
    """A linear body, and a parameter its forward does not use (a loss may use it directly)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(11, 5)
        self.scale = nn.Parameter(torch.ones(5))

    def forward(self, x):
        return self.body(x)


def test_p3_keeps_a_gradient_begun_before_the_pending_agreement_is_in(world):
    """Under p3, rank 0's zero_grad() comes before the step's agreement is in (the other ranks have not
    stepped: they wait for a word from rank 0), so the zeroing waits for it. The next loss uses only `scale`,
    which no rank used in the first step, without calling the model: the agreement is finished in its gradient hook,
    after its new gradient has accumulated. The deferred zeroing must spare it (settle's `fresh`)."""
    needs_two(world)
    model = BodyAndScale()
    dopt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, "p3",
                stall=StallPolicy(warn_after=None, timeout=10.0))
    side, word, r = world.Dup(), np.zeros(1, dtype=np.int64), world.Get_rank()
    waiting = True
    X, Y = batches(world.Get_size(), steps=1)
    v = torch.linspace(-1.0, 1.0, 5)
    dopt.zero_grad()
    nn.functional.cross_entropy(model(local(X[0], r)), local(Y[0], r)).backward()
    if r != 0:
        side.Recv(word, source=0)
    dopt.step()
    dopt.zero_grad()
    if r == 0:
        waiting = dopt.check.pending  # zero_grad() did not finish it: the zeroing waits for owe()
        for peer in range(1, world.Get_size()):
            side.Send(word, dest=peer)
    # scale's zero average of the first step lands first (else using it outside its module is an error).
    i, deadline = dopt._index[id(model.scale)], time.monotonic() + 10
    while dopt.strategy.landing([i]) and time.monotonic() < deadline:
        time.sleep(1e-3)
    (model.scale * v).sum().backward()  # not through model(): no forward hook finishes the agreement
    dopt.step()
    dopt.close()
    side.Free()
    assert_everywhere(world, waiting, "the agreement was in before rank 0's zero_grad(): the case is not exercised")
    reference = BodyAndScale()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    nn.functional.cross_entropy(reference(X[0]), Y[0]).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    (reference.scale * v).sum().backward()
    ref_opt.step()
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), reference.parameters()))
    assert_everywhere(world, same, f"scale {model.scale.data.tolist()} against one process's "
                                   f"{reference.scale.data.tolist()}")


@pytest.mark.parametrize("when", ["after backward", "after step"])
@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "p3"])
def test_rank_raising_mid_step_stops_every_rank(world, strategy, when):
    """Rank 1's data path fails: its error reaches the others quickly, wherever they wait, and nobody hangs.

    After step(), under p3 the others wait in the next forward pass for slices rank 1 owns and no
    longer serves: only the failure beacon can reach them there.
    """
    needs_two(world)
    model, opt = model_and_opt()
    t0 = time.monotonic()

    def run():
        with wrap(opt, model, strategy) as dopt:
            for step in range(5):
                X, Y = batches(world.Get_size(), steps=step + 1)
                r = world.Get_rank()
                dopt.zero_grad()
                nn.functional.cross_entropy(model(local(X[step], r)), local(Y[step], r)).backward()
                if step == 2 and r == 1 and when == "after backward":
                    raise OSError("disk went away")
                dopt.step()
                if step == 2 and r == 1:
                    raise OSError("disk went away")
    message = raised_everywhere(world, run, "disk went away")
    assert_everywhere(world, world.Get_rank() == 1 or "rank 1" in message, message)
    assert_everywhere(world, time.monotonic() - t0 < 30, "took 30 s or more")
    # Nothing left in flight: receives cancelled, sends freed (a stale receive could match later traffic).
    assert_everywhere(world, live_requests() == 0, f"{live_requests()} MPI requests left")
    # Rank 1 joined the agreement round the others waited in: every collective completes, none stays posted.
    never = finish_abandoned(10.0)
    assert_everywhere(world, not never, f"collectives never completed: {never}")
    # And the ranks can carry on with a new optimizer: nothing of the failed one interferes.
    model, opt = model_and_opt()
    with wrap(opt, model, strategy) as dopt:
        for step in range(3):
            one_step(world, model, dopt, step)
    assert_everywhere(world, live_requests() == 0, "requests left after a clean run")


def test_a_rounds_figure_is_the_largest_any_rank_gave_on_every_rank(world):
    check = StepCheck(world, nbits=2)
    try:
        check.run(EXCHANGE, 0, 7, np.array([True, False]), figure=1000 * (world.Get_rank() + 1))
        first = check.figure
        check.run(EXCHANGE, 1, 7, np.array([False, False]))
        assert_everywhere(world, (first, check.figure) == (1000 * world.Get_size(), 0), f"figures {first}, "
                          f"{check.figure}")
    finally:
        check.free()


def second_round_that_rank_1_waits_in(world) -> StepCheck:
    """A StepCheck whose second round every rank has posted, which ranks 0 and 2 have (under MPICH's recursive
    doubling on 4 ranks) completed here while rank 1 still waits for the last rank's part.

    The last rank posts the round first, then makes no MPI call for 0.5 s, holding the GIL: its fail-stop
    watcher's polls would otherwise move its part on."""
    r, last = world.Get_rank(), world.Get_size() - 1
    check = StepCheck(world, nbits=1)
    check.run(EXCHANGE, 0, 0)
    token = np.zeros(1, dtype=np.int64)
    if r == last:
        check.start(EXCHANGE, 1, 0)
        for peer in range(last):
            world.Send(token, dest=peer, tag=99)
        interval, until = sys.getswitchinterval(), time.monotonic() + 0.5
        sys.setswitchinterval(10.0)
        while time.monotonic() < until:
            pass
        sys.setswitchinterval(interval)
    else:
        world.Recv(token, source=last, tag=99)
        check.start(EXCHANGE, 1, 0)
    return check


def next_rounds_until_a_failure(check: StepCheck) -> str:
    """Finish the round in flight and one more, as a rank that did not fail: the PeerFailedError's text."""
    try:
        check.finish()
        check.start(EXCHANGE, 2, 0)
        check.finish()
    except PeerFailedError as exc:
        return str(exc)
    return ""


def test_a_rank_failing_in_a_round_others_completed_joins_the_next_one(world):
    """Rank 1 fails with its agreement round not complete here, though ranks 0 and 2 completed it and
    went on into the next round: rank 1 joins that one too, so no round stays posted anywhere."""
    if world.Get_size() < 3:
        pytest.skip("needs 3 ranks")
    r = world.Get_rank()
    check = second_round_that_rank_1_waits_in(world)
    message = ""
    if r == 1:
        time.sleep(0.2)
        check.notify_failure("OSError: disk went away")
    else:
        message = next_rounds_until_a_failure(check)
    check.stop_listening()
    assert_everywhere(world, r == 1 or "rank 1 stopped with OSError: disk went away" in message, message)
    never = finish_abandoned(10.0)
    assert_everywhere(world, not never, f"collectives never completed: {never}")


def test_two_ranks_failing_at_once_with_different_counts_leave_no_round_posted(world):
    """Ranks 0 and 1 fail at once, each before the other's beacon came: rank 0 after going on into the next
    round, rank 1 with the round before still incomplete here (as above), so their beacons ask for different
    counts. At exit (join_late) every rank joins up to the higher one: no round stays posted anywhere.

    "Before the other's beacon came" is made certain by having each stop listening before it fails.
    """
    if world.Get_size() < 3:
        pytest.skip("needs 3 ranks")
    r = world.Get_rank()
    check = second_round_that_rank_1_waits_in(world)
    message = ""
    if r in (0, 1):
        if r == 0:  # its round completed: it goes on into the next one, then fails (3 posted: asks for 4)
            check.finish()
            check.start(EXCHANGE, 2, 0)
        else:  # its round waits for the last rank (2 posted: asks for 3)
            time.sleep(0.2)
        check.stop_listening()
        check.notify_failure(f"OSError: disk {r} went away")
    else:
        message = next_rounds_until_a_failure(check)
    check.stop_listening()
    asked = world.allgather(check.posted)  # the test's own traffic, on the world communicator
    assert_everywhere(world, r in (0, 1) or "stopped with OSError: disk" in message, message)
    assert_everywhere(world, len(set(asked)) > 1, f"the failures did not race (rounds posted: {asked})")
    check.join_late()  # what mpicomm.shutdown does at exit
    never = finish_abandoned(10.0)
    assert_everywhere(world, not never, f"collectives never completed: {never}")


def test_a_stalled_rank_is_named_and_nobody_waits_for_ever(world):
    """Rank 1 stops calling step(): rank 0's stall report names it, every rank raises StallError (under p3 in
    the next step, where the agreement that step() left in flight is finished)."""
    needs_two(world)
    model, opt = model_and_opt()
    dopt = wrap(opt, model, "p3", stall=StallPolicy(warn_after=None, timeout=2.0))

    def run():
        for step in range(4):
            if step == 2 and world.Get_rank() == 1:
                time.sleep(5)  # busy elsewhere, far past the stall timeout
            one_step(world, model, dopt, step)
    message = raised_everywhere(world, run, "StallError")
    assert_everywhere(world, world.Get_rank() != 0 or "rank(s) [1] have not reached" in message, message)
    dopt.close()
    assert_everywhere(world, live_requests() == 0, f"{live_requests()} MPI requests left")
