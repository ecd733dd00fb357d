"""P3's flat exchange rank by rank: each slice's pushes converge on its owner, one credit covers pushes and results."""

# The representative host stands for every node's compute (data parallelism is
# symmetric), but a flat p3 exchange is not symmetric from moment to moment.
# Slice s is owned by rank s % P: its link takes the other P - 1 ranks' pushes
# of s, then carries the average back to each of them. The symmetric model
# (collectives.slice_round_trip) spreads every slice over every host's link.
# That holds while the ranks' windows cover all owners, as they do in the
# middle of a backward. It does not at the step's edges, when every rank wants
# the same few slices at once (the first layers', which the next forward waits
# for): only their owners' links carry them, and a slice's round trip takes at
# least 2(P - 1)·s over its owner's rate however idle the other links are.
#
# So here every rank is simulated, as mpicomm.sliced_ps runs it:
#   - a heap of outgoing messages per rank, ordered (priority, slice, push before
#     result, peer), at most `credit` of them in flight (pushes and results
#     alike: runtime's credit counts outgoing messages);
#   - the owner averages once its own gradient and every push are in, then
#     queues one result per peer; a rank holds the average once its result is
#     in, the owner once its last result send has gone;
#   - each message pays the latency and half a poll, then moves over its
#     sender's node link out and its receiver's in (shared memory inside a
#     node), max-min fair with everything else on them, its copies on both
#     nodes' cores.
# Node 0 is the run's own host, so the step's small collectives queue behind
# this exchange's bytes on its link as before. The other nodes' cores carry
# only their messages: used where compute is on the device (device "gpu").
# A slice counts as back when every rank holds its average: the slowest rank's
# step is what a run measures.
#
#     4 ranks, credit 2, slices 0 and 1 ready at once (owners 0 and 1):
#       rank 1: push s0 -> 0   push s1 (its own: no message)    results s1 -> 0, 2, 3 (as credit frees)
#       rank 2: push s0 -> 0   push s1 -> 1
#       rank 0: (own s0)       push s1 -> 1    results s0 -> 1, 2, 3 (as credit frees)
#       link into rank 0 carries 3 pushes of s0, link out of rank 1 three results of s1

from __future__ import annotations

import collections
import heapq
from typing import Callable

from .cluster import Host
from .engine import Activity

__all__ = ["OwnerExchange"]

PUSH, RESULT = 0, 1


class _Slice:
    """One slice in flight: its bytes, priority and owner, the pushes in, the owner's results left, who holds it."""

    __slots__ = ("nbytes", "priority", "owner", "pushes_in", "results_left", "holders")

    def __init__(self, nbytes: float, priority: float, owner: int, results: int):
        self.nbytes, self.priority, self.owner = nbytes, priority, owner
        self.pushes_in, self.results_left, self.holders = 0, results, 0


class OwnerExchange:
    """Every rank's queue, credit and pending slices of a flat p3 exchange, on every node's links."""

    def __init__(self, run, credit: int, poll: float, done: Callable[[int], None]):
        c = run.cluster
        self.engine, self.cluster = run.engine, c
        self.P, self.L = c.ranks, c.ranks_per_node
        self.hosts = [run.host] + [Host(run.engine, c, f"node {n}") for n in range(1, c.nodes)]
        self.credit, self.delay, self._done = credit, c.latency + poll / 2, done
        self.holding = False  # runtime.p3's hold: no new message while set
        self._queue: list[list] = [[] for _ in range(self.P)]
        self._outgoing = [0] * self.P
        self._slices: dict[object, _Slice] = {}
        # (sender, receiver) -> its messages not yet delivered, first in first out: [key, kind, nbytes, released]
        self._conns: dict = {}

    def polling(self, on: bool) -> None:
        for h in self.hosts:
            h.polling(on)

    def ready(self, key, nbytes: float, priority: float, owner: int) -> None:
        """Every rank's gradient of slice `key` is ready (their compute runs in step): each pushes it to `owner`."""
        self._slices[key] = _Slice(nbytes, priority, owner, self.P - 1)
        for r in range(self.P):
            if r != owner:
                heapq.heappush(self._queue[r], (priority, key, PUSH, owner))
        self._try_average(key)
        self.pump()

    def pump(self) -> None:
        for r in range(self.P):
            self._send(r)

    def _send(self, r: int) -> None:
        queue = self._queue[r]
        while queue and self._outgoing[r] < self.credit and not self.holding:
            _, key, kind, peer = heapq.heappop(queue)
            self._outgoing[r] += 1
            conn = self._conns.setdefault((r, peer), collections.deque())
            conn.append([key, kind, self._slices[key].nbytes, False])
            if len(conn) == 1:
                self._start(r, peer)
            self._release(r, peer)

    def _release(self, a: int, b: int) -> None:
        """The sends on a -> b that the connection has taken: those within send_buffer bytes of its head's start
        (eager: the transport's socket holds them; 0: a send completes when it is delivered)."""
        queued = 0.0
        for m in self._conns[(a, b)]:
            queued += m[2]
            if queued > self.cluster.send_buffer:
                break
            if not m[3]:
                m[3] = True
                self._sent(a, m[0], m[1])

    def _start(self, a: int, b: int) -> None:
        """The head of a -> b on the wire: after the latency and half a poll, over both nodes' links."""
        key, kind, nbytes, _ = self._conns[(a, b)][0]
        self.engine.process(self._message(a, b, nbytes, f"{'push' if kind == PUSH else 'result'} {key}")) \
            .then(lambda _: self._delivered(a, b))

    def _message(self, a: int, b: int, nbytes: float, name: str):
        yield self.engine.timeout(self.delay)
        c, ha, hb = self.cluster, self.hosts[a // self.L], self.hosts[b // self.L]
        if ha is hb:  # inside a node: shared memory, as the host's own transfers
            act = ha.transfer(name, 0.0, nbytes)
        else:  # cpu_per_byte is a byte sent and one received: half of it at each end
            act = Activity(name, nbytes, uses=((ha.out, 1.0), (hb.into, 1.0)),
                           loads=((ha.cores, c.cpu_per_byte / 2), (hb.cores, c.cpu_per_byte / 2)),
                           cap=c.transport_rate)
        yield self.engine.start(act)

    def _delivered(self, a: int, b: int) -> None:
        conn = self._conns[(a, b)]
        key, kind, _, released = conn.popleft()
        if not released:
            self._sent(a, key, kind)
        if conn:
            self._start(a, b)
            self._release(a, b)
        if kind == PUSH:
            self._slices[key].pushes_in += 1
            self._try_average(key)
        else:
            self._holds(key)  # b has the average
        self.pump()

    def _sent(self, r: int, key, kind: int) -> None:
        """r's send is complete: its credit is free; the owner's last result send frees its slice."""
        self._outgoing[r] -= 1
        if kind == RESULT:
            state = self._slices[key]
            state.results_left -= 1
            if state.results_left == 0:
                self._holds(key)

    def _try_average(self, key) -> None:
        state = self._slices[key]
        if state.pushes_in < self.P - 1:
            return
        for peer in range(self.P):
            if peer != state.owner:
                heapq.heappush(self._queue[state.owner], (state.priority, key, RESULT, peer))

    def _holds(self, key) -> None:
        state = self._slices[key]
        state.holders += 1
        if state.holders == self.P:
            del self._slices[key]
            self._done(key)
