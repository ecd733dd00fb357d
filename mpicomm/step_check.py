"""Per-step agreement across ranks, and an abort beacon that reaches every rank in any wait."""

# At each synchronisation point (a training step, a close) every rank
# contributes its action, step number, a digest of the settings that must
# match (hyper-parameters), whether it found a problem (a NaN gradient) and a
# flag per parameter it used. The common path is one small native
# non-blocking allreduce (MAX over each value and its negation gives min and
# max, MAX over the 0/1 flags their OR): as cheap as MPI makes agreement. Only when
# ranks differ, or one reports a problem, do they gather their descriptions to
# raise the same error naming ranks and values on every rank. Each rank also
# tells rank 0 it has arrived, so that rank 0's stall report can name, like
# Horovod's coordinator, exactly the ranks that have not.
#
# A rank that fails sends every other rank a beacon with its error; each rank
# keeps a receive for it posted, and every wait of the runtime tests it
# (`interrupt`), so the others stop within a poll wherever they wait.
#
# No round may stay posted for ever: MPI cannot cancel a collective, and one
# still posted at MPI_Finalize is a leak. So a failing rank joins the round
# after the last one it posted (others may have completed that one and be
# waiting in the next), marked "stopped", and its beacon says how many rounds
# it posted: a rank hearing it joins up to that count. Every rank then
# completes the same rounds, in the background (mpicomm.requests.abandon)
# once it has stopped. Two ranks failing at once, each before the other's
# beacon came, may ask for different counts: at exit every failed agreement
# reads the beacons that came after it stopped listening and joins up to
# the highest count (join_late), so every rank ends at the same one.

from __future__ import annotations

import time
import zlib
from typing import Callable

import numpy as np
from mpi4py import MPI

from .agree import group_by_value
from .failstop import PeerFailedError, peer_failed
from .requests import RequestLog, abandon, cancel_receives, drain_at_exit, join_late_at_exit
from .stall import SPIN_SECONDS, WATCH, StallError, StallPolicy, wait_until
from .validate import CollectiveMismatchError

EXCHANGE, CLOSE, METRIC, BARRIER, GATHER, EVALUATE, CHECKPOINT = 1, 2, 3, 4, 5, 6, 7
_ACTION = {EXCHANGE: "step", CLOSE: "close()", METRIC: "sum_over_ranks()", BARRIER: "barrier()", GATHER: "a gather",
           EVALUATE: "evaluate()", CHECKPOINT: "a checkpoint"}
TEXT = 240  # bytes of a failure beacon: the rounds its sender posted (int64), then the error text
_TAG_ARRIVED, _TAG_BEACON = 1, 3
# action, -action, step, -step, settings, -settings, problem, stopped (1 + the rank, in a joined round), figure
_HEAD = 9
_STOPPED, _FIGURE = 7, 8


class ReportedProblem(RuntimeError):
    """Some rank reported a problem with its step (text sent with EXCHANGE); raised on every rank, naming them."""


def digest(text: str) -> int:
    return zlib.crc32(text.encode())


class StepCheck:
    """One agreement round per synchronisation point, on a private duplicate of `comm`."""

    def __init__(self, comm: MPI.Comm, nbits: int, policy: StallPolicy | None = None, names=None,
                 watch: bool = False):
        self.comm = drain_at_exit(comm.Dup())
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.policy = policy or StallPolicy.from_env()
        self.nbits = nbits
        # With a progress thread driving MPI, this thread's rounds only watch (see mpicomm.stall).
        self.spin = WATCH if watch else SPIN_SECONDS
        self.names = names
        self._vec = np.zeros(_HEAD + nbits, dtype=np.int64)
        self._out = np.zeros_like(self._vec)
        self._arrivals = np.zeros(self.size, dtype=np.int64)
        self._arrival_log = RequestLog("step agreement: arrivals")
        self._round = None  # (action, step, settings, text, describe) of a round started, not finished
        self._arrived: list = []
        self._request = None
        self.broken = False  # a round failed: no more rounds
        self.everyone_knows = False  # ...and every rank raised (or heard of) it: nobody to tell
        self.posted = 0  # rounds this rank posted, joined ones included
        self.figure = 0  # the largest `figure` of the last round finished, over ranks
        self._late = 0  # the most rounds a beacon asked for that came as this rank stopped listening
        self._beacon_in = np.zeros(TEXT, dtype=np.uint8)
        self._beacon_log = RequestLog("step agreement: failure beacon")
        self._beacon = self._beacon_log.irecv(self.comm, [self._beacon_in, MPI.BYTE], MPI.ANY_SOURCE, _TAG_BEACON) \
            if self.size > 1 else None
        if self.size > 1:
            join_late_at_exit(self)

    def free(self) -> None:
        """Normal end only (every rank got here): a failed one keeps its communicator, see notify_failure."""
        self.stop_listening()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def stop_listening(self) -> None:
        """Error path (or the end): post nothing more, cancel what is posted. Idempotent, never communicates.

        The beacon receive and a round's arrival messages are cancelled (a
        beacon arriving later stays unmatched on this never-freed
        communicator); the round's allreduce, which MPI cannot cancel, is
        completed in the background once every rank has posted it.
        """
        self.broken = True
        self._take_beacon()
        self._beacon_log.cancel()
        self._arrival_log.cancel()
        self._arrived = []
        if self._request is not None:
            abandon(self._request, "step agreement: a round", keep=(self._vec, self._out))
            self._request = None

    def _take_beacon(self, grace: float = 1.0) -> None:
        """Cancel the beacon receive; a beacon it matched meanwhile still counts its rounds (for join_late)."""
        req, self._beacon = self._beacon, None
        if req is None:
            return
        status = MPI.Status()
        if cancel_receives([req], grace, [status]):  # a matched beacon is small (eager): it completes at once too
            return  # left to the log's cancel(), which frees it
        if not status.Is_cancelled():
            self._late = max(self._late, int(self._beacon_in[:8].view(np.int64)[0]))

    def join_late(self) -> None:
        """At exit (mpicomm.shutdown), after a failure: join up to the most rounds any beacon asked for.

        Two ranks that fail at once, each before the other's beacon came,
        announce different counts, and each rank joined the count of the first
        beacon it heard: the higher count's last rounds would stay posted. Every
        beacon reaches every rank, so reading the ones that came late and
        joining their highest count puts every rank at the same count.
        """
        if not self.broken or self.size == 1 or self.comm == MPI.COMM_NULL:
            return
        rounds, status, raw = self._late, MPI.Status(), np.zeros(TEXT, dtype=np.uint8)
        while self.comm.Iprobe(MPI.ANY_SOURCE, _TAG_BEACON, status):
            self.comm.Recv([raw, MPI.BYTE], status.Get_source(), _TAG_BEACON)
            rounds = max(rounds, int(raw[:8].view(np.int64)[0]))
        self._join(rounds)

    # -- failures ---------------------------------------------------------------------
    def interrupt(self, late: bool = True) -> None:
        """What every wait of the runtime calls between polls: raise PeerFailedError if another rank has sent its
        failure beacon (cheap: one MPI_Test), or, when a round left in flight (start() without finish()) has
        completed with the ranks at different points or settings, that round's error on every rank (finish()).
        Without the second, a rank past its step() (p3's agreement stays in flight) waiting for what a rank that
        is not in this step would send (p3's pushes of a rank that closed early) heard of it only at the stall
        limit. `late`: a peer's ^C gives this rank's own a moment first (failstop.peer_failed)."""
        self._heard(late)
        if self._round is not None and self._request is not None and self._request.Test() and self._disagree():
            self.finish()  # raises: the ranks that differ wait here or in their own finish(), all in _explain

    def _disagree(self) -> bool:
        """Whether the completed round's reduced values mean an error: ranks apart, settings apart, a problem
        reported, or a stopped rank's join."""
        out = self._out
        return bool((out[0:6:2] != -out[1:6:2]).any() or out[6] or out[_STOPPED])

    def _heard(self, late: bool = True) -> None:
        """Raise PeerFailedError if another rank has sent its failure beacon; not a round's error (see interrupt:
        the round's own waits call this one)."""
        if self._beacon is None:
            return
        status = MPI.Status()
        if self._beacon.Test(status):
            self._beacon = None
            self.broken = self.everyone_knows = True
            self._join(int(self._beacon_in[:8].view(np.int64)[0]))
            text = bytes(self._beacon_in[8:status.Get_count(MPI.BYTE)]).decode(errors="replace")
            if text.startswith("PeerFailedError: "):  # it was passing another rank's failure on: name that one
                raise peer_failed(text.removeprefix("PeerFailedError: "), late)
            raise peer_failed(f"rank {status.Get_source()} stopped with {text}", late)

    def _join(self, rounds: int) -> None:
        """Post rounds marked "stopped" until this rank has posted `rounds`: ranks waiting in them complete them."""
        while self.posted < rounds:
            vec = np.zeros_like(self._vec)
            vec[_STOPPED] = self.rank + 1
            out = np.empty_like(vec)
            abandon(self.comm.Iallreduce(vec, out, op=MPI.MAX), "step agreement: a round joined after a failure",
                    keep=(vec, out))  # held there, not here: this object may go before the other ranks join
            self.posted += 1

    def notify_failure(self, text: str, grace: float = 1.0) -> None:
        """This rank stops: tell every other rank, wherever it waits. Its messages are not waited for long."""
        self.broken = True
        if self.size == 1 or self.everyone_knows:
            return
        try:
            self._heard(late=False)  # another rank's beacon came first: every rank hears that one, joins its rounds
        except PeerFailedError:
            return
        self.everyone_knows = True
        # One round more than this rank posted, even when its own round has not completed here: the
        # others may have completed it already and be waiting in the next one, which this rank would
        # never start. Nobody can be further: that round needs this rank.
        rounds = self.posted + 1
        raw = np.concatenate([np.array([rounds], dtype=np.int64).view(np.uint8),
                              np.frombuffer(text.encode()[:TEXT - 8], dtype=np.uint8)])
        log = RequestLog("step agreement: failure notice")
        for r in range(self.size):
            if r != self.rank:
                log.isend(self.comm, [raw, MPI.BYTE], r, _TAG_BEACON)
        self._join(rounds)  # after the beacons: a rank that completes the joined round finds one
        # Small messages leave at once (eager); after the grace period the sends are freed and
        # still delivered. The communicator is never freed after this (see DistributedOptimizer).
        log.cancel(grace)

    # -- one round --------------------------------------------------------------
    def run(self, action: int, step: int, settings: int, used: np.ndarray | None = None, text: str = "",
            describe: Callable[[], list[str]] | None = None, policy: StallPolicy | None = None,
            figure: int = 0) -> np.ndarray:
        """Agree with every rank; returns the OR over ranks of `used` (bools), or raises on every rank.

        text: a problem this rank found (every rank then raises ReportedProblem
        naming it). describe(): this rank's settings as "name=value" lines,
        gathered only when the `settings` digests differ, to name the values.
        """
        self.start(action, step, settings, used, text, describe, figure)
        return self.finish(policy)

    def start(self, action: int, step: int, settings: int, used: np.ndarray | None = None, text: str = "",
              describe: Callable[[], list[str]] | None = None, figure: int = 0) -> None:
        """The first half of run(): post this rank's part and return; finish() completes the round.

        figure: a whole number >= 0 of this rank's (a step's duration); after finish(), `figure` holds the
        largest any rank gave, the same on every rank.
        """
        if self.broken:
            raise RuntimeError("an earlier agreement round failed: this object cannot be used any more")
        if self._round is not None:
            raise RuntimeError("the previous agreement round was not finished")
        vec = self._vec
        vec[:_HEAD] = (action, -action, step, -step, settings, -settings, int(bool(text)), 0, max(0, int(figure)))
        vec[_HEAD:] = np.asarray(used, dtype=bool) if used is not None else 0
        self._round = (action, step, settings, text, describe)
        if self.size == 1:
            self._out[:] = vec
            return
        self.posted += 1
        log = self._arrival_log
        if self.rank == 0:
            self._arrived = [log.irecv(self.comm, [self._arrivals[r:r + 1], MPI.INT64_T], r, _TAG_ARRIVED)
                             for r in range(1, self.size)]
        else:
            self._arrivals[0] = step
            self._arrived = [log.isend(self.comm, [self._arrivals[:1], MPI.INT64_T], 0, _TAG_ARRIVED)]
        self._request = self.comm.Iallreduce(vec, self._out, op=MPI.MAX)

    @property
    def round_elements(self) -> int:
        """int64 elements of one round's vectors (its header and the nbits of usage): what MPI reads and writes."""
        return self._vec.size

    @property
    def pending(self) -> bool:
        return self._round is not None

    def ready(self) -> bool:
        """A round was started and can be finished without waiting (one MPI_Test; False when none is pending)."""
        return self._round is not None and (self._request is None or bool(self._request.Test()))

    def finish(self, policy: StallPolicy | None = None) -> np.ndarray:
        """Complete the round start() began: the OR of `used`, or the same error on every rank."""
        action, step, settings, text, describe = self._round
        if self.size > 1:
            try:
                self._wait(step, policy or self.policy)
            except (StallError, PeerFailedError):
                self.broken = True
                raise
        self._round = None
        self._heard()  # a round can complete with a rank that has given up meanwhile
        out = self._out
        self.figure = int(out[_FIGURE])
        if out[_STOPPED]:
            self._stopped(int(out[_STOPPED]) - 1)
        if (out[0:6:2] != -out[1:6:2]).any() or out[6]:
            self._explain(action, step, settings, text, describe)
        return out[_HEAD:] > 0

    def _wait(self, step: int, policy: StallPolicy) -> None:
        log, arrived, request = self._arrival_log, self._arrived, self._request
        if self.rank != 0 and policy.timeout is not None:
            # Rank 0 alone can name the missing ranks: the others give it time to say so first
            # (its failure beacon then ends their wait with its report).
            policy = StallPolicy(policy.warn_after, policy.timeout + max(1.0, 0.1 * policy.timeout))

        def missing() -> str:
            if self.rank != 0:
                return "a rank has not reached this point; rank 0's report names it"
            # Testall leaves every request untouched unless all completed: ask each one.
            late = [r + 1 for r, req in enumerate(arrived) if not req.Test()]
            return f"rank(s) {late} have not reached this point (step #{step + 1}); the others wait for them"
        try:
            wait_until(request.Test, what=f"agreement on step #{step + 1}", report=missing, policy=policy,
                       who=f"rank {self.rank}: ", interrupt=self._heard, spin=self.spin)
            # Sent before each rank's allreduce began: delivered by now, or nearly.
            wait_until(lambda: MPI.Request.Testall(arrived), what="arrivals", policy=policy,
                       who=f"rank {self.rank}: ", interrupt=self._heard, spin=self.spin)
            log.release()
        except (StallError, PeerFailedError):
            log.cancel()
            raise

    def _stopped(self, rank: int, grace: float = 1.0) -> None:
        """The round completed only because a rank that stopped joined it: its beacon, sent first, says why."""
        self.broken = True
        deadline = time.monotonic() + grace
        while self._beacon is not None and time.monotonic() < deadline:
            self._heard()  # raises PeerFailedError with the beacon's text
            time.sleep(1e-3)
        self.everyone_knows = True
        raise PeerFailedError(f"rank {rank} stopped with an error (its failure beacon did not arrive)")

    # -- the rare path: name what differs ----------------------------------------------
    def _explain(self, action: int, step: int, settings: int, text: str, describe) -> None:
        """Every rank together (all saw the same reduced values): gather the details, raise the same error."""
        self.broken = self.everyone_knows = True
        mine = (action, step, settings, text, describe() if describe is not None else [])
        rows = self.comm.allgather(mine)  # failure path only: pickling is fine
        if len({(a, s) for a, s, *_ in rows}) > 1:
            raise CollectiveMismatchError("ranks are at different points: " + group_by_value(
                [f"{_ACTION.get(a, a)} #{s + 1}" if a == EXCHANGE else f"{_ACTION.get(a, a)} after {s} steps"
                 for a, s, *_ in rows]))
        if len({d for _, _, d, *_ in rows}) > 1:
            lists = [r[4] for r in rows]
            for i in range(max(len(x) for x in lists)):
                column = [x[i] if i < len(x) else "(missing)" for x in lists]
                if any(c != column[0] for c in column):
                    raise CollectiveMismatchError(f"settings differ across ranks: {group_by_value(column)}")
            raise CollectiveMismatchError("settings differ across ranks (their digests differ)")
        raise ReportedProblem("; ".join(f"rank {r}: {row[3]}" for r, row in enumerate(rows) if row[3]))
