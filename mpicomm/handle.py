"""Handles for non-blocking collectives written as generators that yield the MPI requests they wait on."""

from __future__ import annotations

from typing import Callable, Generator, Iterable

from mpi4py import MPI

from .requests import RequestLog, abandon

# An algorithm is a generator: it posts Isend/Irecv (through its RequestLog), yields the list of
# requests it needs completed before its next local step, and returns its result. The
# algorithm thus reads as straight-line code, while the handle decides when to block (wait)
# or merely poll (test). Instead of a list it may yield a Step: something other than its own
# requests that must happen first (mpicomm.native: collectives started earlier must be settled).
Algorithm = Generator[list, None, object]


class Step:
    """A wait point that is not a list of this handle's requests: `poll(block)` is True once passed."""

    def poll(self, block: bool) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class CancelledError(RuntimeError):
    """The collective was cancelled (an error path) before it completed."""


class Handle:
    """A collective in flight: `test()` advances it without blocking, `wait()` finishes it, `cancel()` drops it."""

    __slots__ = ("name", "_gen", "_reqs", "_done", "_result", "_error", "_log")

    def __init__(self, name: str, algorithm: Algorithm, log: RequestLog | None = None):
        self.name = name
        self._gen = algorithm
        self._log = log
        self._reqs: list = []
        self._done = False
        self._result = None
        self._error: BaseException | None = None
        self._advance()  # post the first messages right away

    def _advance(self) -> None:
        """Run the algorithm to its next wait point."""
        try:
            self._reqs = self._gen.send(None)
        except StopIteration as stop:
            self._finish(stop.value, None)
        except BaseException as exc:
            # An error raised by validation happens before any point-to-point traffic;
            # whatever else was posted is cancelled so it cannot match later messages.
            self._finish(None, exc)
            if self._log is not None:
                self._log.cancel()

    def _finish(self, result, error) -> None:
        self._done, self._result, self._error, self._reqs = True, result, error, []
        if self._log is not None and error is None:
            self._log.release()

    def _ready(self, block: bool) -> bool:
        """Whether the current wait point is passed; with block, wait until it is. A Step that raises (a piece
        of a pipelined collective) ends the handle with its error, as the algorithm raising would."""
        reqs = self._reqs
        if type(reqs) is list:
            if block:
                MPI.Request.Waitall(reqs)
                return True
            return MPI.Request.Testall(reqs)
        try:
            return reqs.poll(block)
        except BaseException as exc:
            self._gen.close()
            self._finish(None, exc)
            if self._log is not None:
                self._log.cancel()
            return False

    @property
    def done(self) -> bool:
        return self._done

    def test(self) -> bool:
        """Progress as far as possible without blocking; True once complete."""
        while not self._done and self._ready(False):
            self._advance()
        if self._done and self._error is not None:
            raise self._error
        return self._done

    def wait(self):
        """Block until complete and return the result (the output buffer)."""
        while not self._done:
            if self._ready(True):
                self._advance()
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        """Error path: stop the algorithm, cancel its receives, free its sends. Idempotent."""
        if self._done:
            return
        self._gen.close()
        if self._log is not None:
            self._log.cancel()
        if type(self._reqs) is list:  # left: collectives (fingerprints, MPI's own), which MPI cannot cancel
            for r in self._reqs:
                # Nothing to keep here: mpi4py holds a fingerprint Iallgather's arrays itself, and MPI's own calls
                # were abandoned with their buffers as the algorithm closed (mpicomm.native.Sequencer.wait).
                abandon(r, f"{self.name} (cancelled)", keep=())
        self._done, self._error, self._reqs = True, CancelledError(f"{self.name} was cancelled"), []

    def then(self, fn: Callable) -> "Then":
        """A handle whose result is fn(this handle's result), computed once, on completion."""
        return Then(self, fn)

    def __repr__(self) -> str:
        state = "done" if self._done else f"{len(self._reqs)} requests pending"
        return f"<Handle {self.name}: {state}>"


class Then:
    """`handle.then(fn)`: completes with the inner handle and applies fn to its result (DDP's Future.then)."""

    __slots__ = ("inner", "fn", "_has", "_result")

    def __init__(self, inner, fn: Callable):
        self.inner, self.fn, self._has, self._result = inner, fn, False, None

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def done(self) -> bool:
        return self._has

    def _complete(self, value):
        if not self._has:
            self._result, self._has = self.fn(value), True
        return self._result

    def test(self) -> bool:
        if self._has:
            return True
        if not self.inner.test():
            return False
        self._complete(self.inner.wait())
        return True

    def wait(self):
        return self._complete(self.inner.wait()) if not self._has else self._result

    def cancel(self) -> None:
        self.inner.cancel()

    def then(self, fn: Callable) -> "Then":
        return Then(self, fn)


def wait_all(handles: Iterable[Handle]) -> list:
    """Finish several handles, progressing all of them so none starves the others."""
    handles = list(handles)
    pending = [h for h in handles if not h.done]
    while pending:
        # Block on one handle's current step while polling the rest: every
        # algorithm advances, and no rank spins without ever blocking.
        head = pending[0]
        if isinstance(head, Handle):
            if head._ready(True):
                head._advance()
        else:
            head.wait()
        pending = [h for h in pending if not h.test()]
    return [h.wait() for h in handles]
