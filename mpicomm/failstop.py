"""Fail-stop for a whole job: one rank's uncaught exception or early exit stops every rank, each saying why."""

# Installed by `import runtime` (install() here). A plain `mpiexec -n 4 python
# train.py` otherwise hangs when one rank fails: the others wait for it in their
# next collective, and its own interpreter blocks in MPI_Finalize at exit, so
# mpiexec never sees it die (`python -m mpi4py` aborts instead, as Horovod and
# torch's elastic agent tear a job down).
#
# Every rank keeps a receive posted on COMM_WORLD from each other rank for notices
# (tag TAG_UB, which no collective of this library uses). A rank that stops sends every other rank
# a notice (the failing rank, its error, its step):
#
# - an uncaught exception (sys.excepthook), or run_main's: the traceback, then
#   FAILED notices;
# - the interpreter's exit (atexit, before mpi4py's MPI_Finalize): an EXIT
#   notice, then a wait until every other rank has exited too, so that no rank
#   sits in MPI_Finalize while the others still need it.
#
# Every wait of the runtime (mpicomm.stall.wait_until) calls check(), which
# raises PeerFailedError once a notice has arrived: a FAILED one at once, an EXIT
# one once the wait has gone on EXIT_GRACE seconds after it (the rank is gone:
# what it took part in has arrived by then, what it never joins never will). A rank blocked
# where nothing polls (a user's own collective, comm.Dup() at wrap) is stopped by
# the watcher thread PICKUP seconds later, if its main thread did not take the
# notice up (and, for an EXIT notice, only while it is inside this library).
# A stopping rank waits up to GRACE seconds for every other rank's FAILED notice, so
# that each prints its line before the first exit makes mpiexec end the job,
# then leaves with os._exit(1): no MPI_Finalize that could block. A
# KeyboardInterrupt (^C, which mpiexec passes to every rank) prints one line a
# rank, where it was, not a traceback a rank, and every rank leaves with 130.
#
# Opt out: MPITRAIN_FAILSTOP=0 before importing runtime, or disable().

from __future__ import annotations

import atexit
import os
import signal
import struct
import sys
import sysconfig
import threading
import time
import traceback
import weakref

import numpy as np
from mpi4py import MPI

from . import stall

ENV = "MPITRAIN_FAILSTOP"
POLL = 0.05  # seconds between the watcher's tests of the notice receive
PICKUP = 3.0  # seconds a notice may wait for the main thread before the watcher stops the rank
GRACE = 10.0  # seconds a stopping rank waits for every other rank's notice
# Seconds a wait goes on after a rank exited: a wait it took part in completes (the exiting rank keeps
# MPI going until every rank has exited), one it never joins would wait for ever.
EXIT_GRACE = 2.0
FAILED, EXIT = 1, 2
INTERRUPTED = 130  # a shell's status for a process ended by SIGINT (128 + 2)
LATE_SIGINT = 0.2  # seconds: a rank that hears of another's ^C first waits this long for its own
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_HEADER = struct.Struct("<iiq")  # origin rank, kind, its step (-1: none)
TEXT = 2048
_PACKAGES = tuple(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + p + os.sep
                  for p in ("mpicomm", "runtime"))


class PeerFailedError(RuntimeError):
    """Another rank stopped (an error, or it exited); raised on the ranks that were waiting for it."""


class PeerInterruptedError(PeerFailedError, KeyboardInterrupt):
    """Another rank's ^C, heard here first: `except KeyboardInterrupt` catches it as it catches this rank's own."""


def peer_failed(message: str, late: bool = True) -> PeerFailedError:
    """The error for another rank's stop; for its ^C, made after a moment (`late`) in which this rank's own SIGINT,
    which mpiexec sent every rank, comes first if it is on its way (its KeyboardInterrupt is raised from the sleep)."""
    if not _interrupt(message):
        return PeerFailedError(message)
    if late:
        time.sleep(LATE_SIGINT)
    return PeerInterruptedError(message)


class _Guard:
    def __init__(self):
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.tag = self.comm.Get_attr(MPI.TAG_UB)
        self.lock = threading.RLock()
        self.open: dict[int, weakref.ref] = {}  # optimizers and pipelines not closed yet, in the order made
        self.heard: dict[int, tuple] = {}  # rank -> (origin, kind, step, text, when), its latest notice
        self.failure: tuple | None = None  # the first notice that stops this rank's waits
        self.raised = False  # check() raised it: the main thread took the notice up
        self.stopping = False
        self.exiting = False  # the main thread is in _at_exit: it looks at notices itself
        # One receive per peer, not one from MPI.ANY_SOURCE: across hosts, MPICH's UCX netmod left
        # ANY_SOURCE receives unmatched for ever (4 emulated hosts, tcp), while receives naming their
        # source completed at once. Thousands of ranks cost 2 KiB and one request per peer.
        self._bufs = np.zeros((self.size, _HEADER.size + TEXT), dtype=np.uint8)
        self._sent: list = []  # (buffer, request) of notices, alive until the process ends
        self._reqs = [self._post(r) if r != self.rank else MPI.REQUEST_NULL for r in range(self.size)]
        self._statuses = [MPI.Status() for _ in range(self.size)]  # Testsome's, made once: polls run every step
        self._receiving = self.size > 1
        self._last_poll = 0.0
        self._done = threading.Event()
        self._watcher = None
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:  # else only the runtime's waits (main thread) look
            self._watcher = threading.Thread(target=self._watch, name="mpitrain-failstop", daemon=True)
            self._watcher.start()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._at_exit)

    # -- notices -----------------------------------------------------------------------------
    def _post(self, source: int):
        return self.comm.Irecv([self._bufs[source], MPI.BYTE], source, self.tag)

    def _poll(self) -> None:
        """Take every notice that has arrived (under the lock: the watcher and the main thread both poll)."""
        with self.lock:
            if not self._receiving:
                return
            statuses = self._statuses
            done = MPI.Request.Testsome(self._reqs, statuses) or []
            for j, i in enumerate(done):  # statuses[j] belongs to the j-th completed request, as in MPI
                buf = self._bufs[i]
                origin, kind, step = _HEADER.unpack_from(buf)
                text = bytes(buf[_HEADER.size:statuses[j].Get_count(MPI.BYTE)]).decode(errors="replace")
                notice = (origin, kind, step, text, time.monotonic())
                self.heard[i] = notice
                if self.failure is None or (self.failure[1] == EXIT and kind == FAILED):
                    self.failure = notice
                self._reqs[i] = self._post(i)

    def _send(self, origin: int, kind: int, step: int, text: str) -> None:
        raw = text.encode()[:TEXT]
        buf = np.frombuffer(_HEADER.pack(origin, kind, step) + raw, dtype=np.uint8).copy()
        for r in range(self.size):
            if r != self.rank:
                self._sent.append((buf, self.comm.Isend([buf, MPI.BYTE], r, self.tag)))

    def opened(self) -> list:
        return [o for o in (ref() for ref in list(self.open.values())) if o is not None]

    def steps(self) -> int:
        return max((o.steps for o in self.opened()), default=-1)

    # -- the runtime's waits ------------------------------------------------------------------
    def check(self) -> None:
        if self._watcher is None and time.monotonic() - self._last_poll > POLL:
            self._last_poll = time.monotonic()
            self._poll()
        notice = self.failure
        if notice is None or self.stopping:
            return
        if notice[1] == EXIT and (self.exiting or time.monotonic() - notice[4] < EXIT_GRACE):
            return  # what it sent before leaving is still arriving; past the grace, nobody will answer
        self.raised = True
        raise peer_failed(describe(notice))

    # -- stopping -----------------------------------------------------------------------------
    def stop(self, origin: int, text: str, step: int, say: str = "") -> None:
        """Tell every other rank, wait for theirs (so that every rank prints), then leave: exit status 1, or 130
        when the origin was interrupted (^C), whichever rank mpiexec sees exit first."""
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second ^C at the last rank must not cut this short
        if say:
            sys.stderr.write(say if say.endswith("\n") else say + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        self._send(origin, FAILED, step, text)
        # Wait for a FAILED notice from every rank, not any notice: a rank that exited early sent EXIT and
        # prints its own line only once it hears ours; leaving sooner lets mpiexec kill it first.
        deadline = time.monotonic() + GRACE
        while not self._all_stopping() and time.monotonic() < deadline:
            self._poll()
            time.sleep(POLL / 10)
        os._exit(INTERRUPTED if _interrupt(text) else 1)

    def _all_stopping(self) -> bool:
        return all(self.heard.get(r, (0, 0))[1] == FAILED for r in range(self.size) if r != self.rank)

    def _excepthook(self, kind, exc, tb) -> None:
        if self.stopping or self.size == 1:
            return self._previous_hook(kind, exc, tb)
        self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """This rank's exception ends the job: its traceback (for a peer's failure or ^C, one line), then stop()."""
        if isinstance(exc, PeerFailedError):  # not this rank's error: the line names the rank that failed
            deadline = time.monotonic() + 0.5  # heard through an optimizer's beacon first: the origin's notice
            while self.failure is None and time.monotonic() < deadline:  # is on its way
                self._poll()
                time.sleep(POLL / 10)
            origin, _, step, text, _ = self.failure or (self.rank, FAILED, self.steps(), f"PeerFailedError: {exc}", 0)
            say = f"[rank {self.rank}] PeerFailedError: {exc}"
        elif isinstance(exc, KeyboardInterrupt):
            origin, step, text = self.rank, self.steps(), error_text(exc)
            say = f"[rank {self.rank}] {text}" + (f" (after {step} steps)" if step >= 0 else "")
        else:
            origin, step, text = self.rank, self.steps(), error_text(exc)
            lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip("\n")
            say = "".join(f"[rank {self.rank}] {line}\n" for line in lines.split("\n"))
        self.stop(origin, text, step, say)

    def _watch(self) -> None:
        while not self._done.wait(POLL):
            self._poll()
            notice = self.failure
            if notice is None or self.raised or self.stopping or self.exiting or time.monotonic() - notice[4] < PICKUP:
                continue
            where = _main_thread_place()
            if notice[1] == EXIT and not where.startswith(_PACKAGES):
                continue  # a user's own work: the rank may still finish, and exit in turn
            origin, _, step, text, _ = notice
            self.stop(origin, text, step, f"[rank {self.rank}] stopping: {describe(notice)}; this rank was "
                                          f"blocked in {where or 'an unknown place'}, where no wait looks")

    def _at_exit(self) -> None:
        if self.stopping:
            return
        self.exiting = True
        open_ = self.opened()
        step = self.steps()
        note = f"its script ended (or called sys.exit) after {step} steps" if step >= 0 else "its script ended"
        if open_:
            note += f" with {type(open_[0]).__name__} still open (no close())"
        self._poll()
        if self.failure is None or self.failure[1] != FAILED:
            self._send(self.rank, EXIT, step, note)
        warn = stall.StallPolicy.from_env().warn_after
        start, next_report = time.monotonic(), warn
        while True:
            self._poll()
            if self.failure is not None and self.failure[1] == FAILED:
                self._stop_at_exit(note)
            if len(self.heard) >= self.size - 1:
                break
            waited = time.monotonic() - start
            if next_report is not None and waited >= next_report:
                missing = [r for r in range(self.size) if r != self.rank and r not in self.heard]
                print(f"[mpitrain] rank {self.rank}: exited; waiting for rank(s) {missing} to finish (after "
                      f"{waited:.0f} s)", file=sys.stderr, flush=True)
                next_report += warn
            time.sleep(POLL / 5 if waited < 1 else POLL)
        if open_ and all(n[1] == EXIT and n[2] == step for n in self.heard.values()):
            # Every rank ended after the same steps without closing: close together (in the order made).
            for obj in open_:
                obj.close()
        self._release()

    def _stop_at_exit(self, note: str) -> None:
        """A rank stopped while this one exits: say which (this one, if the others needed it), and stop."""
        origin, _, step, text, _ = self.failure
        if origin == self.rank:
            say = f"[rank {self.rank}] exited ({note}) while the other ranks still needed it: the job stops"
        else:
            say = f"[rank {self.rank}] exiting; {describe(self.failure)}"
        self.stop(origin, text, step, say)

    def _release(self) -> None:
        """The normal end: no notice receive left posted at MPI_Finalize, no watcher polling during it."""
        self._done.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        with self.lock:
            if self._receiving:
                for req in self._reqs:
                    if req != MPI.REQUEST_NULL:
                        req.Cancel()
                MPI.Request.Waitall(self._reqs)
                self._receiving = False
            deadline = time.monotonic() + 1.0  # delivered: every other rank has exited after hearing it
            while not MPI.Request.Testall([r for _, r in self._sent]) and time.monotonic() < deadline:
                time.sleep(1e-3)
        sys.excepthook = self._previous_hook


def describe(notice: tuple) -> str:
    """'rank 1 stopped with OSError: ... (after 20 steps)' for a notice."""
    origin, kind, step, text, _ = notice
    after = f" (after {step} steps)" if step >= 0 else ""
    if kind == EXIT:
        return f"rank {origin} exited: {text}; it can no longer take part"
    return f"rank {origin} stopped with {text}{after}"


def _main_thread_place() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


_GUARD: _Guard | None = None


def install() -> None:
    """Turn fail-stop on for this process (idempotent; a no-op on one rank or with MPITRAIN_FAILSTOP=0)."""
    global _GUARD
    if _GUARD is not None or os.environ.get(ENV, "1").strip().lower() in ("0", "off", "no", "false"):
        return
    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    _GUARD = _Guard()
    stall.set_job_check(_GUARD.check)


def disable() -> None:
    """Turn fail-stop off: failures are yours to handle (a rank that fails may leave the others waiting)."""
    global _GUARD
    if _GUARD is not None:
        stall.set_job_check(None)
        atexit.unregister(_GUARD._at_exit)
        _GUARD._release()
        _GUARD = None


def installed() -> bool:
    return _GUARD is not None


def check() -> None:
    """Raise PeerFailedError if another rank has stopped (called by every wait of the runtime)."""
    if _GUARD is not None:
        _GUARD.check()


def register(obj) -> None:
    """An optimizer or pipeline (with .steps, .close()) that is open: its step goes into notices; at exit it is
    said, or closed when every rank ends after the same steps."""
    if _GUARD is not None:
        _GUARD.open[id(obj)] = weakref.ref(obj)


def unregister(obj) -> None:
    if _GUARD is not None:
        _GUARD.open.pop(id(obj), None)


def error_text(exc: BaseException) -> str:
    """What the other ranks are told of this rank's `exc`: 'OSError: disk gone', or for ^C where it was."""
    if isinstance(exc, PeerFailedError):  # passed on: the ranks that hear it name the first rank (StepCheck)
        return f"PeerFailedError: {exc}"
    return interrupted(exc) if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"


def _interrupt(text: str) -> bool:
    """Whether a notice's or beacon's text is a ^C: this rank's own line (error_text), or another's heard."""
    return text.startswith("KeyboardInterrupt") or "stopped with KeyboardInterrupt" in text


def interrupted(exc: KeyboardInterrupt) -> str:
    """One line for ^C: the innermost place outside Python's own library where the rank was."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_STDLIB)]
    where = f" in {frames[-1].name} ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"KeyboardInterrupt: interrupted{where}"


def fail(exc: BaseException) -> bool:
    """Stop the job for this rank's `exc` (run_main's path); False when fail-stop is off (the caller aborts)."""
    if _GUARD is None:
        return False
    _GUARD.fail(exc)
    return True
