"""How a Pipeline ends: closing agreed with every rank, or released after a failure (its own, or heard)."""

from __future__ import annotations

from mpicomm import failstop
from mpicomm.step_check import CLOSE

from .divergence import heard


def fail(pipe, exc: BaseException) -> BaseException:
    """Stop this pipeline (the other ranks hear of it); the exception to raise (another rank's divergence: ours)."""
    exc = heard(exc)
    if pipe.failed is None:
        pipe.failed = exc
        if pipe.check is not None:
            pipe.check.notify_failure(failstop.error_text(exc))
        if pipe.dopt is not None:
            pipe.dopt.abort(exc)
        if pipe.link is not None:
            pipe.link.cancel()
        if pipe.check is not None:
            pipe.check.stop_listening()  # now: a failed pipeline may never be closed
    return exc


def abort(pipe, exc: BaseException) -> None:
    """This rank stops with `exc`: the other ranks raise PeerFailedError (PeerInterruptedError for a ^C) in their
    waits; nothing more is agreed, and this stage's state_dict() stays its own to save."""
    if not pipe._closed:
        fail(pipe, exc)
        close(pipe)


def close(pipe) -> None:
    """Drain, agree that every rank got here after as many steps, release everything (collective)."""
    if pipe._closed:
        return
    try:
        if pipe.failed is None:
            pipe.drain()
            if pipe.link is not None:
                pipe.link.flush_sends()
            pipe._round(CLOSE)
            pipe.check.finish()
    except BaseException as exc:
        raise fail(pipe, exc)
    finally:
        pipe._closed = True
        release(pipe)


def release(pipe) -> None:
    """Free what this rank holds; after a failure only what no message of another rank can still reach."""
    failstop.unregister(pipe)
    if pipe.link is not None:
        pipe.link.close() if pipe.failed is None else pipe.link.cancel()
    if pipe.dopt is not None and pipe.failed is None:
        pipe.dopt.close()
    if pipe.check is not None and pipe.failed is None:
        pipe.check.free()
    if pipe.layout is not None and pipe.failed is None:
        pipe.layout.free()
    if pipe._own_topology and pipe.failed is None:
        pipe.topology.free()
