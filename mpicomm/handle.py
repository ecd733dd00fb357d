"""Handles for non-blocking collectives written as generators that yield the MPI requests they wait on."""

from __future__ import annotations

from typing import Generator, Iterable

from mpi4py import MPI

# An algorithm is a generator: it posts Isend/Irecv, yields the list of
# requests it needs completed before its next local step, and returns its
# result. The algorithm thus reads as straight-line code, while the handle
# decides when to block (wait) or merely poll (test).
Algorithm = Generator[list, None, object]


class Handle:
    """A collective in flight: `test()` advances it without blocking, `wait()` finishes it."""

    __slots__ = ("name", "_gen", "_reqs", "_done", "_result", "_error")

    def __init__(self, name: str, algorithm: Algorithm):
        self.name = name
        self._gen = algorithm
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
            self._done, self._result, self._reqs = True, stop.value, []
        except BaseException as exc:
            # Cancel nothing here: an error raised by validation happens before
            # any point-to-point traffic, and other errors are fatal anyway.
            self._done, self._error, self._reqs = True, exc, []

    @property
    def done(self) -> bool:
        return self._done

    def test(self) -> bool:
        """Progress as far as possible without blocking; True once complete."""
        while not self._done and MPI.Request.Testall(self._reqs):
            self._advance()
        if self._done and self._error is not None:
            raise self._error
        return self._done

    def wait(self):
        """Block until complete and return the result (the output buffer)."""
        while not self._done:
            MPI.Request.Waitall(self._reqs)
            self._advance()
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        state = "done" if self._done else f"{len(self._reqs)} requests pending"
        return f"<Handle {self.name}: {state}>"


def wait_all(handles: Iterable[Handle]) -> list:
    """Finish several handles, progressing all of them so none starves the others."""
    handles = list(handles)
    pending = [h for h in handles if not h.done]
    while pending:
        # Block on one handle's current step while polling the rest: every
        # algorithm advances, and no rank spins without ever blocking.
        head = pending[0]
        MPI.Request.Waitall(head._reqs)
        head._advance()
        pending = [h for h in pending if not h.test()]
    return [h.wait() for h in handles]
