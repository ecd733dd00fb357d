"""P3's exchange: gradients cut into slices, each slice owned by one rank, pushed and pulled by priority.

Every rank is both a worker and the parameter server of 1/P of the slices
(round-robin), so every link carries traffic both ways. A slice's priority is
its layer's place in the forward pass: the first layer's slices go first, and
a slice that becomes ready later but ranks higher overtakes queued ones. At
most `credit` outgoing messages are in flight, so the queue, not MPI, decides
the order. All MPI calls of an iteration happen on the progress thread; the
backward hooks only enqueue.
"""

from __future__ import annotations

import heapq
import threading

import torch
from mpi4py import MPI

from .buffers import Buffer
from .progress import Task
from .tags import check_tag

PUSH, RESULT = 0, 1


class SlicePlan:
    """Which slice covers which elements of which tensor, who owns it, and its tags."""

    def __init__(self, sizes: list[int], slice_size: int, ranks: int, comm: MPI.Comm):
        if slice_size < 1:
            raise ValueError(f"slice_size must be >= 1, got {slice_size}")
        self.slices: list[tuple[int, int, int]] = []  # (tensor, start, stop)
        self.by_tensor: list[list[int]] = []
        for t, n in enumerate(sizes):
            ids = []
            for a in range(0, n, slice_size):
                ids.append(len(self.slices))
                self.slices.append((t, a, min(a + slice_size, n)))
            self.by_tensor.append(ids)
        self.ranks = ranks
        self.count = len(self.slices)
        if self.count:
            check_tag(comm, 2 * self.count - 1)  # push tags 0..S-1, result tags S..2S-1

    def owner(self, s: int) -> int:
        return s % self.ranks

    def push_tag(self, s: int) -> int:
        return s

    def result_tag(self, s: int) -> int:
        return self.count + s


class SlicedExchange:
    """The long-lived state of P3 on one communicator: plan, priorities, receive scratch."""

    def __init__(self, comm: MPI.Comm, sizes: list[int], slice_size: int, credit: int = 8,
                 timeline=None, dtype=torch.float32):
        if credit < 1:
            raise ValueError(f"credit must be >= 1, got {credit}")
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.plan = SlicePlan(sizes, slice_size, self.size, self.comm)
        self.credit = credit
        self.timeline = timeline
        self.priority = list(range(len(sizes)))  # replaced by forward order once known
        # Receive buffers for the pushes of the slices this rank owns: one per peer, reused every step.
        self.owned = [s for s in range(self.plan.count) if self.plan.owner(s) == self.rank]
        self.scratch = {s: torch.empty((self.size - 1, self.plan.slices[s][2] - self.plan.slices[s][1]), dtype=dtype)
                        for s in self.owned} if self.size > 1 else {}
        self.current: Iteration | None = None

    def set_priorities(self, priority: list[int]) -> None:
        """priority[t]: smaller is more urgent (the tensor's layer position in the forward pass)."""
        self.priority = list(priority)

    def begin(self) -> "Iteration":
        self.current = Iteration(self)
        return self.current

    def free(self) -> None:
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


class Iteration(Task):
    """One synchronisation of every tensor; polled by the progress thread until all slices are averaged."""

    def __init__(self, ex: SlicedExchange):
        self.ex = ex
        n = len(ex.plan.by_tensor)
        self.grads: list = [None] * n
        self.tensor_done = [threading.Event() for _ in range(n)]
        self._left_in_tensor = [len(ids) for ids in ex.plan.by_tensor]
        self._inbox: list[int] = []  # tensors made ready by the backward pass, not yet seen by the poller
        self._lock = threading.Lock()
        self._queue: list = []  # heap of (priority, slice, kind, dest)
        self._out: list = []  # (request, kind, slice, dest, timeline token)
        self._in: list = []  # (request, kind, slice, timeline token)
        self._arrived = {s: 0 for s in ex.owned}
        self._local_ready = set()
        self._results_left = {s: ex.size - 1 for s in ex.owned}
        self._slices_left = ex.plan.count
        self._posted = False
        for t, ids in enumerate(ex.plan.by_tensor):
            if not ids:  # empty tensor: nothing to exchange
                self.tensor_done[t].set()

    # -- called from the training thread ------------------------------------
    def ready(self, t: int, grad: torch.Tensor) -> None:
        """The gradient of tensor t is final for this step; `grad` is a contiguous tensor of its elements."""
        if not grad.is_contiguous():
            raise ValueError(f"gradient of tensor {t} is not contiguous")
        with self._lock:
            self.grads[t] = grad.reshape(-1)
            self._inbox.append(t)

    # -- called from the progress thread -------------------------------------
    def poll(self) -> bool:
        if not self._posted:
            self._post_push_receives()
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for t in inbox:
            self._enqueue_tensor(t)
        self._send_from_queue()
        self._complete_outgoing()
        self._complete_incoming()
        self._send_from_queue()
        return self._slices_left == 0 and not self._out and not self._in

    def _post_push_receives(self) -> None:
        ex, plan = self.ex, self.ex.plan
        for s in ex.owned:
            peers = [p for p in range(ex.size) if p != ex.rank]
            for k, peer in enumerate(peers):
                req = ex.comm.Irecv([Buffer(ex.scratch[s][k]).bytes(), MPI.BYTE], peer, plan.push_tag(s))
                self._in.append((req, PUSH, s, None))
        self._posted = True

    def _enqueue_tensor(self, t: int) -> None:
        ex = self.ex
        prio = ex.priority[t]
        for s in ex.plan.by_tensor[t]:
            if ex.size == 1:
                self._slice_done(s)
            elif ex.plan.owner(s) == ex.rank:
                self._local_ready.add(s)
                self._try_aggregate(s)
            else:
                heapq.heappush(self._queue, (prio, s, PUSH, ex.plan.owner(s)))

    def _view(self, s: int) -> torch.Tensor:
        t, a, z = self.ex.plan.slices[s]
        return self.grads[t][a:z]

    def _send_from_queue(self) -> None:
        ex, plan, tl = self.ex, self.ex.plan, self.ex.timeline
        while self._queue and len(self._out) < ex.credit:
            prio, s, kind, dest = heapq.heappop(self._queue)
            tag = plan.push_tag(s) if kind == PUSH else plan.result_tag(s)
            token = tl.begin(f"{'push' if kind == PUSH else 'send result'} s{s}", "p3", track="push",
                             slice=s, peer=dest, priority=prio) if tl else None
            req = ex.comm.Isend([Buffer(self._view(s)).bytes(), MPI.BYTE], dest, tag)
            self._out.append((req, kind, s, dest, token))

    def _complete_outgoing(self) -> None:
        if not self._out:
            return
        ex, plan, tl = self.ex, self.ex.plan, self.ex.timeline
        idx = MPI.Request.Testsome([o[0] for o in self._out])
        if not idx:
            return
        done = set(idx)
        for i in idx:
            _, kind, s, dest, token = self._out[i]
            if tl:
                tl.end(token)
            if kind == PUSH:
                # Only now may the slice's memory receive the averaged result: it was the send buffer.
                token = tl.begin(f"pull s{s}", "p3", track="pull", slice=s, peer=dest) if tl else None
                req = ex.comm.Irecv([Buffer(self._view(s)).bytes(), MPI.BYTE], dest, plan.result_tag(s))
                self._in.append((req, RESULT, s, token))
            else:
                self._results_left[s] -= 1
                if self._results_left[s] == 0:
                    self._slice_done(s)
        self._out = [o for i, o in enumerate(self._out) if i not in done]

    def _complete_incoming(self) -> None:
        if not self._in:
            return
        tl = self.ex.timeline
        idx = MPI.Request.Testsome([i[0] for i in self._in])
        if not idx:
            return
        done = set(idx)
        for i in idx:
            _, kind, s, token = self._in[i]
            if kind == PUSH:
                self._arrived[s] += 1
                self._try_aggregate(s)
            else:
                if tl:
                    tl.end(token)
                self._slice_done(s)
        self._in = [x for i, x in enumerate(self._in) if i not in done]

    def _try_aggregate(self, s: int) -> None:
        """Owner: once every peer's push and the local gradient are in, average and send back."""
        ex = self.ex
        if s not in self._local_ready or self._arrived[s] < ex.size - 1:
            return
        view = self._view(s)
        tl = ex.timeline
        token = tl.begin(f"aggregate s{s}", "p3", track="comm", slice=s) if tl else None
        view.add_(ex.scratch[s].sum(dim=0)).div_(ex.size)
        if tl:
            tl.end(token)
        prio = ex.priority[ex.plan.slices[s][0]]
        for peer in range(ex.size):
            if peer != ex.rank:
                heapq.heappush(self._queue, (prio, s, RESULT, peer))

    def _slice_done(self, s: int) -> None:
        self._slices_left -= 1
        t = self.ex.plan.slices[s][0]
        self._left_in_tensor[t] -= 1
        if self._left_in_tensor[t] == 0:
            self.tensor_done[t].set()

    def __repr__(self) -> str:
        return f"<P3 iteration: {self._slices_left} slices left, {len(self._out)} out, {len(self._in)} in>"

