"""close() after a backward without step(): what was in flight is cancelled on every rank and dropped when the
strategy frees its communicators, so that the next optimizer on the same ranks trains as one process."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere, queued
from mpicomm import requests
from mpicomm.progress import HandlesTask, HandleTask, ProgressThread
from runtime import DistributedOptimizer, HybCommOptions, WfbpOptions
from dp_helpers import Branchy, batches, close, local, max_diff, sgd, wrap

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

STEPS = 4


def trained(world, strategy, X, Y, **kw):
    """Branchy after STEPS steps under `strategy` (one process: strategy None, every rank's batch)."""
    torch.manual_seed(7)
    model, P, r = Branchy(), world.Get_size(), world.Get_rank()
    opt = sgd(model)
    dopt = wrap(opt, model, strategy, **kw) if strategy else opt
    for step in range(STEPS):
        dopt.zero_grad()
        ranks = [r] if strategy else range(P)
        loss = sum(nn.functional.cross_entropy(model(local(X[step], q)), local(Y[step], q)) for q in ranks)
        (loss / len(ranks)).backward()
        dopt.step()
    if strategy:
        dopt.close()
    return [p.detach().clone() for p in model.parameters()]


def close_in_flight(world, strategy, **kw):
    """Two steps of a wide model, then a backward without step(), rank r 20*r ms late, and close(): what the
    exchange had in flight is cancelled on every rank at its own point. Nothing may stay queued for the
    communicators MPI builds next."""
    r = world.Get_rank()
    torch.manual_seed(3)
    wide = nn.Sequential(nn.Linear(1000, 1500), nn.ReLU(), nn.Linear(1500, 1000))
    dopt = wrap(sgd(wide), wide, strategy, **kw)
    x = torch.randn(8, 1000)
    for _ in range(2):
        dopt.zero_grad()
        wide(x).square().mean().backward()
        dopt.step()
    dopt.zero_grad()
    time.sleep(0.02 * r)  # rank 3's exchange starts last, just before every rank agrees to close
    wide(x).square().mean().backward()  # no step: close() cancels what is still in flight
    dopt.close()
    later = [world.Dup() for _ in range(64)]  # more than close() freed: MPI takes their contexts again
    world.Barrier()
    time.sleep(0.2)  # what a peer sent before its close() has landed by now
    stale = queued(later)
    for c in later:
        c.Free()
    assert_everywhere(world, not stale, f"{strategy}: stale messages (source, tag, bytes) {stale}")


@pytest.mark.parametrize("strategy,kw", [("allreduce", {}), ("wfbp", {}), ("p3", {}), ("hybcomm", {}),
                                         ("allreduce", {"pto": True}), ("wfbp", {"pto": True}),
                                         ("p3", {"credit": "online"})])
def test_the_next_optimizer_trains_as_one_process(world, strategy, kw):
    """A wide model's backward without step(), rank 3's last: the exchange is cut short at different points on
    different ranks. Run as a script on 2 fake hosts x 2, the code before mpicomm.quiesce left a wfbp ring chunk or
    a p3 slice queued on the freed communicators in 2 runs of 3; the communicators built next here saw none of
    them (MPI gave them other contexts), so the checks that bite are tests/test_quiesce_mpi.py's and
    tests/test_node_stage_mpi.py's: this one covers the path end to end."""
    close_in_flight(world, strategy, **kw)
    X, Y = batches(world.Get_size(), steps=STEPS)
    got, want = trained(world, strategy, X, Y, **kw), trained(world, None, X, Y)
    assert_everywhere(world, close(got, want), f"{strategy}: {max_diff(got, want):.3g} from one process")


@pytest.mark.parametrize("strategy,kw", [("topk", {}), ("hier-topk", {}), ("topk", {"pto": True})])
def test_the_next_optimizer_trains_as_a_fresh_one(world, strategy, kw):
    """The same for the sparse strategies (top-k is not one process's SGD): the optimizer built after
    the cancelled close() trains bitwise as the one built before it."""
    X, Y = batches(world.Get_size(), steps=STEPS)
    want = trained(world, strategy, X, Y, **kw)
    close_in_flight(world, strategy, **kw)
    got = trained(world, strategy, X, Y, **kw)
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    assert_everywhere(world, same, f"{strategy}: {max_diff(got, want):.3g} from the run before the cancelled close")


def held() -> Counter:
    """Requests this rank holds posted or abandoned, by owner."""
    return Counter({owner: sum(n) for owner, n in requests.left_posted().items()}) \
        + Counter(f"{owner} (abandoned)" for owner in requests.abandoned_by())


def added_since(before: Counter) -> Counter:
    """What is held now that was not before; abandoned collectives finished first, as at exit (one that every rank
    posted completes), and earlier tests' may complete meanwhile."""
    requests.finish_abandoned(2.0)
    return held() - before


def test_a_layer_the_census_starts_as_close_aborts_is_cancelled(world, monkeypatch):
    """hybcomm: a layer that waited for the census is started on the progress thread; if close() aborts that thread
    between the layer's allgathervs being posted and their task being handed over, the task is refused, and its
    collectives must be cancelled there, not left posted (a fresh-clone CI run found one SFB layer's two at exit on
    one rank). Here the progress thread pauses at that point while the training thread closes."""
    from runtime.hybrid import factors

    before, r, paused = held(), world.Get_rank(), threading.Event()
    start = factors.FactorExchange.start

    def slow_start(self, *args):
        handles = start(self, *args)
        if threading.current_thread() is not threading.main_thread():
            paused.set()
            time.sleep(0.5)  # posted, not yet submitted: close() stops the progress thread meanwhile
        return handles
    monkeypatch.setattr(factors.FactorExchange, "start", slow_start)
    torch.manual_seed(3)
    wide = nn.Sequential(nn.Linear(100, 150), nn.ReLU(), nn.Linear(150, 100))
    dopt = wrap(sgd(wide), wide, HybCommOptions(force="sfb"))
    x = torch.randn(8, 100)
    time.sleep(0.1 * r)  # rank 0's layers are ready before the last rank's census: they wait for it
    wide(x).square().mean().backward()  # no step
    dopt.close()
    world.Barrier()
    left = added_since(before)
    hit = world.allreduce(int(paused.is_set()))
    assert_everywhere(world, hit > 0 and not left, f"{hit} rank(s) paused; left on this rank: {left}")


@pytest.mark.parametrize("strategy", ["wfbp", "hybcomm"])  # p3 posts from its progress thread alone
def test_a_gradient_the_staging_thread_delivers_as_close_aborts_is_cancelled(world, monkeypatch, strategy):
    """Compute off the host (emulated here, a GPU alike): gradients reach the strategy from the staging thread. If
    close() after a backward without step() aborts the strategy while that thread hands a gradient over, what the
    hand-over posted must still be cancelled; and hybcomm's census, posted at the first gradient, must be posted on
    every rank or none (close() drains the thread first). Here the staging thread pauses just before its submit."""
    from runtime.emulate import emulate, emulate_optimizer, emulated_loss
    from runtime.emulate.accelerator import deactivate
    from runtime.hybrid.census import CensusTask
    from runtime.workloads.models import build_model, model_input

    paused, submit = threading.Event(), ProgressThread.submit

    def slow_submit(self, task):
        posted = isinstance(task, (HandleTask, HandlesTask)) or getattr(task, "task", None) is not None
        if threading.current_thread().name == "mpitrain-staging" and posted and not paused.is_set():
            paused.set()
            time.sleep(0.5)  # its collectives posted: close() aborts the strategy meanwhile
        future = submit(self, task)
        if isinstance(task, CensusTask):  # hybcomm: once the census is in, the staging thread starts the layers
            future.wait_done(10)
        return future
    deactivate()
    before = held()
    try:
        torch.manual_seed(0)
        model = build_model("mlp")
        (x,), y = model_input("mlp", 16)
        emulate(model, "v100", (x,))
        opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        how = WfbpOptions(fuse_bytes=1 << 16) if strategy == "wfbp" else HybCommOptions(force="sfb")
        dopt = DistributedOptimizer(opt, model, how)
        for _ in range(2):
            dopt.zero_grad()
            emulated_loss(model(x), y).backward()
            dopt.step()
        monkeypatch.setattr(ProgressThread, "submit", slow_submit)
        dopt.zero_grad()
        emulated_loss(model(x), y).backward()  # no step
        dopt.close()
    finally:
        deactivate()
    world.Barrier()
    left = added_since(before)
    hit = world.allreduce(int(paused.is_set()))
    assert_everywhere(world, hit > 0 and not left, f"{hit} rank(s) paused; left on this rank: {left}")
