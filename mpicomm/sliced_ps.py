"""P3's exchange: flat gradient buffers cut into slices, each owned by one rank, pushed and pulled by priority."""

# Every rank is both a worker and the parameter server of 1/P of the slices
# (round-robin), so every link carries traffic both ways. Slices are cut from
# flat buffers (one per dtype) without regard to tensor boundaries, so small
# tensors share a slice instead of paying a message each. A slice's priority
# is that of its most urgent tensor (its layer's place in the forward pass):
# the first layer's slices go first, and a slice that becomes ready later but
# ranks higher overtakes queued ones. At most `credit` outgoing messages are in
# flight, so the queue, not MPI, decides the order. All MPI calls happen on the
# progress thread; the backward hooks only enqueue. While `holding` (set by the
# owner) nothing new is sent: what is in flight drains, so that small collectives
# of the owner's cross the link behind it alone. Buffers, byte views and
# receive scratch are built once: a step allocates nothing but a few lists.
# A poll is one Testsome over every request of the step. The progress thread
# polls every `relaxed_sleep` (a fraction of a slice's time on the wire) unless
# the training thread waits for a layer's last few slices: then it is nudged
# awake and polls every `urgent_sleep`.
#
# On nodes of several ranks (`nodes`, node_aggregation), each slice is first
# summed inside its node by one of the node's ranks, only that rank exchanges
# it with the owner's node, and it shares the average inside the node: a slice
# crosses a node's link once each way, as a ring's bytes do, not once per rank.
# Pushes to the node's own aggregator are paced (`local_rate`, one at a time):
# MPICH polls its network module only when its shared-memory one made no
# progress in that call, so a rank pushing half its gradients to its neighbour
# at once would starve its node's traffic across the link meanwhile. With
# `node_window`, those pushes and results go through one MPI-3 shared window
# per node instead (mpicomm.node_window): zero-byte notices, nothing to pace.
#
#     slice s, nodes [0 1] [2 3]: aggregator local rank s % 2, owner node (s // 2) % 2
#     s = 3: 0 -> 1 and 2 -> 3 (node pushes), 1 -> 3 (cross push); 3 averages all four;
#            3 -> 1 (cross result), 1 -> 0 and 3 -> 2 (node results)

from __future__ import annotations

import collections
import heapq
import threading
import warnings

import numpy as np
import torch
from mpi4py import MPI

from .node_window import NOTICE, NodeWindow
from .pacing import Pacer
from .progress import Task
from .quiesce import quiesce
from .requests import RequestLog, drain_at_exit
from .slice_plan import SlicePlan
from .slice_waits import SliceWaits

PUSH, RESULT = 0, 1
IN_PUSH, IN_RESULT, OUT_PUSH, OUT_RESULT = range(4)  # what a request in flight is
# While a layer waits for its slices, completions must be seen soon: the progress thread then sleeps
# at most an eighth of relaxed_sleep (within these bounds); otherwise polling every relaxed_sleep
# (about a quarter of a slice's time on the wire) costs the compute threads no core.
URGENT_SLEEP_MIN, URGENT_SLEEP_MAX = 20e-6, 100e-6


class SlicedExchange(SliceWaits, Task):
    """P3 on one communicator: the plan, persistent views and scratch, and the state of the step in flight.

    One step at a time: `begin()` starts a step (the previous one must be
    complete), `ready(t)` from the training thread hands over tensor t, the
    progress thread calls `poll()`, and `wait(tensors)` blocks until those
    tensors hold the average over ranks.
    """

    def __init__(self, comm: MPI.Comm, buffers: list[torch.Tensor], segments: list[tuple[int, int, int]],
                 slice_size: int, credit: int = 8, timeline=None, names: list[str] | None = None,
                 relaxed_sleep: float = 100e-6, nodes: list[list[int]] | None = None,
                 node_aggregation: bool = True, local_rate: float | None = None, node_window: bool = True):
        if not isinstance(credit, int) or credit < 1:
            raise ValueError(f"credit must be an integer >= 1, got {credit!r}")
        if not relaxed_sleep > 0:
            raise ValueError(f"relaxed_sleep must be > 0 seconds, got {relaxed_sleep!r}")
        self.comm = drain_at_exit(comm.Dup())
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        # nodes: the ranks of `comm` by node (mpicomm.Topology.nodes); they count cross_bytes, and with
        # node_aggregation route each slice through its node's aggregator.
        self.plan = plan = SlicePlan([b.numel() for b in buffers], segments, slice_size, self.size, self.comm,
                                     nodes if node_aggregation else None)
        self.credit, self.timeline, self.relaxed_sleep = credit, timeline, relaxed_sleep
        self.urgent_sleep = min(URGENT_SLEEP_MAX, max(URGENT_SLEEP_MIN, relaxed_sleep / 8))
        self._waiters = 0  # training threads blocked in wait()
        self._urgent = False  # the one waiting needs few slices more: the progress thread polls urgently
        self.nudge = lambda: None  # set by the owner: wakes its progress thread from a relaxed sleep
        # Set by the owner: called on the polling thread as each slice's result is in, with the slice and the
        # tensors it completed (often none), before a waiter can see them done (the owner's copy of the
        # averages back to a GPU starts there).
        self.on_done = None
        self.names = names or [f"tensor {t}" for t in range(len(segments))]
        self.views = [buffers[b][a:z] for b, a, z in plan.slices]
        self.wire = [v.view(torch.uint8).numpy() for v in self.views]  # what MPI sends and receives into
        self.sources, self.upstream, self.downstream = plan.routes(self.rank)
        self.owned = [s for s in range(plan.count) if self.sources[s]]  # slices this rank sums pushes of
        node_of = {r: k for k, n in enumerate(nodes or [list(range(self.size))]) for r in n}
        self.window = None
        if node_window and plan.nodes is not None:
            try:
                self.window = NodeWindow(self.comm, plan, self.wire, [v.dtype for v in self.views])
            except RuntimeError as exc:  # on every rank alike: the node's ranks share no memory, so no MPI
                warnings.warn(f"{exc}: its pushes go as messages")  # shared memory either, nothing to starve
        # Per peer: its pushes and results are notices, their bytes in the node's window (node_window).
        self._windowed = [self.window is not None and p != self.rank and node_of[p] == node_of[self.rank]
                          for p in range(self.size)]
        self.scratch, self.push_in = {}, {}  # per owned slice: what its sum adds, and each source's receive
        for s in self.owned:
            rows = iter(torch.empty((sum(not self._windowed[p] for p in self.sources[s]), self.views[s].numel()),
                                    dtype=self.views[s].dtype))
            self.scratch[s] = [self.window.source(p, s) if self._windowed[p] else next(rows) for p in self.sources[s]]
            self.push_in[s] = [NOTICE if self._windowed[p] else r.view(torch.uint8).numpy()
                               for p, r in zip(self.sources[s], self.scratch[s])]
        self._nothing_to_send = np.array([not ids for ids in plan.slices_of], dtype=bool)
        self.tensor_done = self._nothing_to_send.copy()  # per tensor: holds the average of this step
        self.slice_priority = list(range(plan.count))
        self.set_priorities(list(range(len(segments))))
        # Entered as the lock itself, never through the Condition: a ^C in Condition.__enter__ can leave it held
        # by the training thread for ever (mpicomm.progress.ABORT_JOIN), and the progress thread blocked on it.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._inbox: collections.deque = collections.deque()  # tensors handed over, not yet seen by the poller
        self.active = False
        self.holding = False  # set and cleared by the owner's thread: _send_from_queue then sends nothing new
        self.error: BaseException | None = None
        self._aborted = False
        self.log = RequestLog("p3 sliced exchange")
        self.messages = self.polls = 0  # sent and polled so far (benchmarks read them)
        self._crosses = [node_of.get(p, -1) != node_of.get(self.rank, -2) for p in range(self.size)]
        self.cross_bytes = 0  # sent to ranks on other nodes so far (tests and benchmarks read it)
        # local_rate: bytes a second of pushes to this node's aggregators (None: as fast as the queue allows).
        pace = local_rate is not None and node_aggregation and len(nodes or []) > 1 and bool(self.wire)
        self._paced = [pace and not c and p != self.rank and not w  # node peers, by message
                       for p, (c, w) in enumerate(zip(self._crosses, self._windowed))]
        self.pacer = Pacer(local_rate, credit * max(w.nbytes for w in self.wire)) if any(self._paced) else None
        self._reset()

    def set_priorities(self, priority: list[int]) -> None:
        """priority[t]: smaller is more urgent (the tensor's layer position in the forward pass)."""
        self.slice_priority = [min((priority[t] for t in ts), default=0) for ts in self.plan.tensors_of]

    # -- one step ---------------------------------------------------------------------
    def _reset(self) -> None:
        plan = self.plan
        self._tensors_left = [len(ts) for ts in plan.tensors_of]  # per slice: tensors not yet handed over
        self._slices_left = [len(ids) for ids in plan.slices_of]  # per tensor: slices not yet averaged
        self.tensor_done[:] = self._nothing_to_send  # in place: averaged() hands out this array
        self._arrived = {s: 0 for s in self.owned}
        self._got = {s: [False] * len(self.sources[s]) for s in self.owned}  # which sources' pushes arrived
        self._local_ready = [False] * plan.count
        self._results_left = [len(d) for d in self.downstream]
        self._left = plan.count
        self._slice_finished = [False] * plan.count
        self._queue: list = []  # heap of (priority, slice, kind, peer)
        self._held: list = []  # the same, for pushes the pacer holds back
        if self.pacer is not None:
            self.pacer.reset()
        # Every request of the step, sends and receives; a completed one stays as MPI.REQUEST_NULL (Testsome
        # makes it so) until more than half are, so that a poll does not rebuild the lists.
        self._reqs: list = []
        self._what: list = []  # (IN_PUSH/IN_RESULT/OUT_PUSH/OUT_RESULT, slice, peer position or token) per request
        self._active = 0  # requests in _reqs not yet completed
        self._outgoing = 0
        self._posted = False
        self._inbox.clear()

    def set_credit(self, credit: int) -> None:
        """Between steps only: the outgoing messages in flight from the next begin() on."""
        if self.active or not isinstance(credit, int) or credit < 1:
            raise ValueError(f"the credit changes between steps, to an integer >= 1: got {credit!r}"
                             + (" during a step" if self.active else ""))
        self.credit = credit
        if self.pacer is not None:
            self.pacer.burst = credit * max(w.nbytes for w in self.wire)

    def begin(self) -> "SlicedExchange":
        if self.active:
            raise RuntimeError("the previous p3 step is still in flight")
        self._reset()
        self.active = True
        return self

    def ready(self, t: int) -> None:
        """The training thread: tensor t's gradient in the flat buffer is final for this step."""
        self._inbox.append(t)

    # -- the progress thread ---------------------------------------------------------
    def poll(self) -> bool:
        self.polls += 1
        if not self._posted:
            self._post_push_receives()
        inbox = self._inbox
        while inbox:
            self._tensor_ready(inbox.popleft())
        self._send_from_queue()
        if self._active:
            self._complete()
            self._send_from_queue()
        if self._left == 0 and not self._active:
            self.log.release()
            with self._lock:
                self.active = False
                self._cond.notify_all()
            return True
        return False

    def idle_sleep(self) -> float:
        """The longest the progress thread may sleep while nothing completes: short while a layer waits for
        its last few slices (waiting for many, as synchronize() does, completions can wait a relaxed poll)."""
        return self.urgent_sleep if self._waiters and self._urgent else self.relaxed_sleep

    @property
    def outgoing(self) -> int:
        """Outgoing messages in flight (at most `credit`)."""
        return self._outgoing

    def _post_push_receives(self) -> None:
        plan, log, comm = self.plan, self.log, self.comm
        for s in self.owned:
            for k, peer in enumerate(self.sources[s]):
                self._reqs.append(log.irecv(comm, [self.push_in[s][k], MPI.BYTE], peer, plan.push_tag(s)))
                self._what.append((IN_PUSH, s, k))
                self._active += 1
        self._posted = True

    def _tensor_ready(self, t: int) -> None:
        plan = self.plan
        for s in plan.slices_of[t]:
            self._tensors_left[s] -= 1
            if self._tensors_left[s]:
                continue
            if self.size == 1:
                self._slice_done(s)
            else:
                self._local_ready[s] = True
                self._try_aggregate(s)

    def _send_from_queue(self) -> None:
        if self.holding:
            return
        plan, tl, queue, held = self.plan, self.timeline, self._queue, self._held
        while self._outgoing < self.credit:
            if held and (not queue or held[0] < queue[0]) and self.pacer.admits(self.wire[held[0][1]].nbytes):
                prio, s, kind, peer = heapq.heappop(held)
                self.pacer.sent(self.wire[s].nbytes)
            elif queue:  # a held push does not hold up what may go
                prio, s, kind, peer = heapq.heappop(queue)
            else:
                break
            tag = plan.push_tag(s) if kind == PUSH else plan.result_tag(s)
            token = tl.begin(f"{'push' if kind == PUSH else 'send result'} s{s}", "p3", track="push",
                             slice=s, peer=peer, priority=prio) if tl else None
            data = self.wire[s]
            if self._windowed[peer]:  # the bytes through the window, a notice by MPI
                if kind == PUSH:
                    self.window.put(s, data)
                else:
                    self.window.write_result(peer, s, self.views[s])
                data = NOTICE
            self._reqs.append(self.log.isend(self.comm, [data, MPI.BYTE], peer, tag))
            self._what.append((OUT_PUSH if kind == PUSH else OUT_RESULT, s, token))
            self._outgoing += 1
            self._active += 1
            self.messages += 1
            if self._crosses[peer]:
                self.cross_bytes += self.wire[s].nbytes

    def _complete(self) -> None:
        """One Testsome over every request in flight (one pass of MPI's progress engine per poll)."""
        idx = MPI.Request.Testsome(self._reqs)
        if not idx:
            return
        plan, tl, what = self.plan, self.timeline, self._what
        self._active -= len(idx)
        for i in idx:
            kind, s, x = what[i]
            if kind == IN_PUSH:  # x: the source's position in self.sources[s]
                self._got[s][x] = True
                self._arrived[s] += 1
                self._try_aggregate(s)
            elif kind == IN_RESULT:  # x: the pull's timeline token
                if tl:
                    tl.end(x)
                if self._windowed[self.upstream[s]]:
                    self.window.get(s, self.wire[s])
                self._share(s)
            else:
                self._outgoing -= 1
                if tl:
                    tl.end(x)
                if kind == OUT_PUSH:
                    # Only now may the slice's memory receive the averaged result: it was the send buffer.
                    up = self.upstream[s]
                    if self._paced[up]:
                        self.pacer.done()
                    token = tl.begin(f"pull s{s}", "p3", track="pull", slice=s, peer=up) if tl else None
                    into = NOTICE if self._windowed[up] else self.wire[s]
                    self._reqs.append(self.log.irecv(self.comm, [into, MPI.BYTE], up, plan.result_tag(s)))
                    self._what.append((IN_RESULT, s, token))
                    self._active += 1
                else:
                    self._results_left[s] -= 1
                    if self._results_left[s] == 0:
                        self._slice_done(s)
        if 2 * self._active < len(self._reqs):
            keep = [i for i, r in enumerate(self._reqs) if r]  # a completed request is REQUEST_NULL: false
            self._reqs = [self._reqs[i] for i in keep]
            self._what = [what[i] for i in keep]

    def _try_aggregate(self, s: int) -> None:
        """Once the local gradient and every source's push are in: sum; push the sum upstream, or (the owner)
        average and send the average back."""
        if not self._local_ready[s] or (s in self._arrived and self._arrived[s] < len(self.sources[s])):
            return
        view, tl = self.views[s], self.timeline
        if s in self.scratch:
            token = tl.begin(f"aggregate s{s}", "p3", track="comm", slice=s) if tl else None
            if self.window is not None:
                self.window.sync()  # the peers' staged slices, as their notices said
            for row in self.scratch[s]:  # row by row: no temporary the size of the slice
                view.add_(row)
            if tl:
                tl.end(token)
        up = self.upstream[s]
        if up is not None:
            heapq.heappush(self._held if self._paced[up] else self._queue, (self.slice_priority[s], s, PUSH, up))
            return
        view.div_(self.size)
        self._share(s)

    def _share(self, s: int) -> None:
        """The slice holds the average: send it on to those below (each result send's end finishes it), or done."""
        if not self.downstream[s]:
            self._slice_done(s)
            return
        for peer in self.downstream[s]:
            heapq.heappush(self._queue, (self.slice_priority[s], s, RESULT, peer))

    def _slice_done(self, s: int) -> None:
        self._left -= 1
        self._slice_finished[s] = True
        finished = []
        for t in self.plan.tensors_of[s]:
            self._slices_left[t] -= 1
            if self._slices_left[t] == 0:
                finished.append(t)
        if self.on_done is not None:
            self.on_done(s, finished)
        if finished:
            with self._lock:
                for t in finished:
                    self.tensor_done[t] = True
                self._cond.notify_all()

    def abort(self) -> None:
        """Error path: cancel the receives, free the sends, forget the step."""
        self.log.cancel()
        self._aborted = True
        self._reqs, self._what, self._outgoing, self._active = [], [], 0, 0
        with self._lock:
            self.active = False
            self._cond.notify_all()

    def free(self) -> None:
        if self.window is not None:  # after an error a peer may be gone, and Win_free waits for the node's ranks
            self.scratch = {}  # some of it is the window's memory
            self.window.free(clean=self.error is None and not self._aborted)
            self.window = None
        if self.comm != MPI.COMM_NULL:
            if self.error is None:  # every rank frees it (close); pushes and pulls an abort cut short are dropped
                quiesce([self.comm])
            self.comm.Free()

    def __repr__(self) -> str:
        return (f"<P3 exchange: {self._left} slices left, {self._outgoing} out, "
                f"{self._active - self._outgoing} in>")
