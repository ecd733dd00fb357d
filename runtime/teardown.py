"""How a DistributedOptimizer ends: closing agreed with every rank, or released after a failure."""

from __future__ import annotations

from mpicomm import failstop
from mpicomm.step_check import CLOSE

from . import stepping


def fail(dopt, exc: BaseException) -> None:
    """Error path: tell the other ranks, cancel what is in flight, wait for nobody."""
    if dopt.failed is None:
        dopt.failed = exc
        # Not when every rank raised together (a disagreement) or heard of it already.
        dopt.check.notify_failure(failstop.error_text(exc))
        _quiet(dopt)
        dopt.strategy.abort()
        dopt.model_buffers.abandon()
        dopt.check.stop_listening()  # now, not at close(): a job may return without closing


def abort(dopt, exc: BaseException) -> None:
    """This rank stops with `exc`: tell the other ranks (they raise PeerFailedError) and release everything."""
    if not dopt._closed:
        fail(dopt, exc)
        release(dopt)


def close(dopt) -> None:
    """Agree with every rank that training is over, apply what is owed, stop threads, free communicators."""
    if dopt._closed:
        return
    if dopt.failed is not None:
        release(dopt)
        return
    try:
        stepping.settle(dopt)  # a deferred step's agreement first: rounds complete in order
        dopt.check.run(CLOSE, dopt.steps, 0, describe=lambda: [])
        if dopt._open:  # a backward without step() on every rank: nothing to finish
            if dopt.staging is not None:
                # Compute off the host: each rank's gradients, and the collectives they start (hybcomm's census
                # at the first), reach the strategy only from the staging thread. Stopped at once, it would have
                # posted them on the ranks whose copies had landed and not on the others: a collective that never
                # completes. Every rank ran this backward, so every rank hands all of it over first.
                dopt.staging.drain()
            _quiet(dopt)
            dopt.strategy.abort()
        else:
            dopt._flush()
    except BaseException as exc:
        fail(dopt, exc)
        release(dopt)
        raise
    release(dopt)


def _quiet(dopt) -> None:
    """Before the strategy aborts: the staging thread (compute off the host) hands it nothing more, and is out of
    any hand-over, so that what it started is in what the abort cancels."""
    if dopt.staging is not None:
        dopt.staging.stop()


def release(dopt) -> None:
    """Remove the hooks, stop the threads and free what may be freed; once."""
    if dopt._closed:
        return
    dopt._closed = True
    dopt._unroute_zero_grad()
    dopt._step_guard.remove()
    failstop.unregister(dopt)
    for h in dopt._hooks + dopt._capture_hooks:
        h.remove()
    dopt._hooks = dopt._capture_hooks = []
    if dopt.gate is not None:
        dopt.gate.remove()
    for h in (dopt._forward_hook, dopt._state_hook, dopt._load_hook):
        if h is not None:
            h.remove()
    if dopt.staging is not None:
        dopt.staging.close()
    # A failed deferred step leaves placeholders in .grad (GradientBuffers.park): their views go back, so that the
    # model holds gradients a new wrapper can take over. What a loop set itself (None, its own tensors) stays.
    dopt.buffers.unpark([i for i in range(len(dopt.params)) if dopt.buffers.parked(i)])
    if dopt.failed is None:
        dopt.strategy.close()
        if dopt.pto is not None:
            dopt.pto.close()
        dopt.model_buffers.free()
        dopt.check.free()
    else:
        dopt.check.stop_listening()
    # After a failure the strategy's and the agreement's communicators are deliberately not freed:
    # messages other ranks sent before they learnt of the failure may still arrive, and MPI may
    # reuse a freed communicator's context for the next one, which would then receive them.
    release_topology(dopt)


def release_topology(dopt) -> None:
    if dopt._own_topology:
        dopt.topology.free()
