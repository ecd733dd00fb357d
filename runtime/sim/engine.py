"""The simulator's clock: processes that wait on events, and fluid activities sharing links and cores."""

# Why our own loop and not SimPy: what we simulate is fluid. A message is not a
# job that holds a link for a fixed time: every message in flight on a link
# gets its fair share of it (TCP between concurrent connections), so every
# start or end of a message changes the rate, and so the end time, of every
# other one on the same link. SimPy models resources as slots that a process
# holds; rates that change under running activities would mean interrupting and
# rescheduling each of them by hand at every event. Here that is the loop
# itself: between two events every activity's rate is constant, the next event
# is the earliest timer or the earliest activity to finish at its rate, and
# rates are shared again after it (max-min fairness by progressive filling).
# Processes are generators in SimPy's style: they yield an Event (or a list of
# them, all awaited) and resume when it has fired.
#
# CPU contention is a second, coarser stage: an activity may also load a core
# pool (compute by its progress, messages by the CPU time a byte costs); where
# the pool is over-subscribed every activity on it is slowed in proportion
# (processor sharing between runnable threads), after the links have been
# shared. Compute thus slows down while messages are being copied, and
# messages slow down when the cores are all busy, which is what the emulated
# cluster shows on a machine with fewer cores than ranks.

from __future__ import annotations

import heapq
import math
from typing import Callable, Iterable

# Below this many units an activity counts as finished (floating-point remainders of rate x time).
_EPS = 1e-9


class SimulationError(RuntimeError):
    """A simulated schedule that cannot finish (a process waits on something that never fires)."""


class Event:
    """Something that happens once; callbacks added after it has fired run at once."""

    __slots__ = ("fired", "_callbacks", "value")

    def __init__(self):
        self.fired, self._callbacks, self.value = False, [], None

    def succeed(self, value=None) -> "Event":
        if self.fired:
            raise SimulationError("an event fired twice")
        self.fired, self.value = True, value
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
        return self

    def then(self, fn: Callable[["Event"], None]) -> None:
        if self.fired:
            fn(self)
        else:
            self._callbacks.append(fn)


def all_of(events: Iterable[Event]) -> Event:
    """An event that fires once every one of `events` has."""
    events = list(events)
    done = Event()
    left = [len(events)]

    def one(_):
        left[0] -= 1
        if left[0] == 0:
            done.succeed()

    if not events:
        return done.succeed()
    for e in events:
        e.then(one)
    return done


class Resource:
    """A link direction (bytes/s) or anything else activities share max-min fairly in its own units."""

    __slots__ = ("name", "capacity")

    def __init__(self, name: str, capacity: float):
        if not capacity > 0:
            raise ValueError(f"resource {name!r} needs a positive capacity, got {capacity!r}")
        self.name, self.capacity = name, float(capacity)


class Pool:
    """Cores (or GPUs): activities load it in proportion to their rate; over-subscribed, all slow alike.

    reserved: cores taken by something that is not an activity (a progress thread polling, for as
    long as its exchange is pending), set and cleared by schedules; the activities share the rest.
    """

    __slots__ = ("name", "capacity", "reserved")

    def __init__(self, name: str, capacity: float):
        if not capacity > 0:
            raise ValueError(f"pool {name!r} needs a positive capacity, got {capacity!r}")
        self.name, self.capacity, self.reserved = name, float(capacity), 0.0

    @property
    def available(self) -> float:
        # A poller never takes every cycle: the OS still runs the others (at least a tenth here).
        return max(0.1 * self.capacity, self.capacity - self.reserved)


class Activity:
    """`amount` units of work: per unit it takes `uses` [(Resource, units)] and `loads` [(Pool, core-seconds)]."""

    __slots__ = ("name", "remaining", "uses", "loads", "cap", "done", "rate")

    def __init__(self, name: str, amount: float, uses=(), loads=(), cap: float = math.inf):
        if not amount >= 0 or not cap > 0 or (not uses and cap == math.inf):
            raise ValueError(f"activity {name!r}: amount {amount!r}, cap {cap!r} (an unbounded rate needs a resource)")
        self.name, self.remaining, self.cap = name, float(amount), float(cap)
        self.uses, self.loads = tuple(uses), tuple(loads)
        self.done, self.rate = Event(), 0.0


class Engine:
    """Timers, processes and fluid activities; run() advances time to the last event."""

    def __init__(self):
        self.now = 0.0
        self._timers: list = []
        self._seq = 0
        self._active: list[Activity] = []
        self.events = 0  # how many times rates were shared: the simulation's own cost

    # -- waiting ---------------------------------------------------------------------------------
    def timeout(self, delay: float) -> Event:
        if delay < 0:
            raise ValueError(f"negative delay {delay}")
        e = Event()
        self._seq += 1
        heapq.heappush(self._timers, (self.now + delay, self._seq, e))
        return e

    def start(self, activity: Activity) -> Event:
        if activity.remaining <= _EPS:  # nothing to move: done at once, but after the caller has yielded
            self.timeout(0.0).then(lambda _: activity.done.succeed())
        else:
            self._active.append(activity)
        return activity.done

    def process(self, gen) -> Event:
        """Run a generator that yields Events (or lists of them); the returned event fires when it returns."""
        finished = Event()

        def step(event):
            try:
                target = gen.send(event.value if event is not None else None)
            except StopIteration as stop:
                if event is None:  # done without waiting: fire from the loop, not inside the caller's call
                    self.timeout(0.0).then(lambda _, value=stop.value: finished.succeed(value))
                else:
                    finished.succeed(stop.value)
                return
            if isinstance(target, (list, tuple)):
                target = all_of(target)
            if not isinstance(target, Event):
                raise SimulationError(f"a process yielded {target!r}, not an Event")
            target.then(step)

        step(None)
        return finished

    def active_on(self, resource: Resource) -> list[Event]:
        """The completion events of the activities now using `resource`."""
        return [a.done for a in self._active if any(r is resource for r, _ in a.uses)]

    # -- running ---------------------------------------------------------------------------------
    def run(self, until: float = math.inf) -> float:
        while True:
            self._share()
            t_act = min((self.now + a.remaining / a.rate for a in self._active if a.rate > 0), default=math.inf)
            t_timer = self._timers[0][0] if self._timers else math.inf
            t = min(t_act, t_timer)
            if t == math.inf:
                if self._active:
                    raise SimulationError(f"activities stalled with no rate: {[a.name for a in self._active]}")
                return self.now
            if t > until:
                self._advance(until)
                return self.now
            self._advance(t)
            finished = [a for a in self._active if a.remaining <= _EPS * max(1.0, a.rate)]
            if finished:
                self._active = [a for a in self._active if a.remaining > _EPS * max(1.0, a.rate)]
                for a in finished:
                    a.done.succeed()
            while self._timers and self._timers[0][0] <= self.now:
                heapq.heappop(self._timers)[2].succeed()

    def _advance(self, t: float) -> None:
        dt = t - self.now
        for a in self._active:
            a.remaining -= a.rate * dt
        self.now = t

    def _share(self) -> None:
        """Max-min fair rates over the resources (progressive filling), then scale down over-subscribed pools."""
        self.events += 1
        active = self._active
        left: dict = {}
        for a in active:
            a.rate = 0.0
            for r, _ in a.uses:
                left[r] = r.capacity
        free = set(range(len(active)))
        while free:
            # The largest equal increment every free activity can take before a resource fills or a cap binds.
            demand: dict = {}
            for i in free:
                for r, units in active[i].uses:
                    demand[r] = demand.get(r, 0.0) + units
            step = min((left[r] / d for r, d in demand.items() if d > 0), default=math.inf)
            step = min(step, min(active[i].cap - active[i].rate for i in free))
            for i in free:
                active[i].rate += step
            for r, d in demand.items():
                left[r] -= step * d
            full = {r for r, d in demand.items() if d > 0 and left[r] <= 1e-12 * r.capacity}
            free = {i for i in free if active[i].rate < active[i].cap * (1 - 1e-12)
                    and not any(r in full for r, _ in active[i].uses)}
        load: dict = {}
        for a in active:
            for pool, per_unit in a.loads:
                load[pool] = load.get(pool, 0.0) + a.rate * per_unit
        over = {p: p.available / x for p, x in load.items() if x > p.available}
        if over:
            for a in active:
                scale = min((over.get(pool, 1.0) for pool, _ in a.loads), default=1.0)
                a.rate *= scale
