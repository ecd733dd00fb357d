"""The p3 strategy: hand finished gradients to the sliced exchange, wait per layer before its next forward."""

from __future__ import annotations

from mpicomm.progress import ProgressThread
from mpicomm.sliced_ps import SlicedExchange
from mpicomm.stall import wait_until

from ..device.threads import device_setup
from ..strategy import Strategy, StrategyContext
from .copy_back import SliceCopyBack
from .online_credit import CreditTrials
from .tuning import tune


class P3Sync(Strategy):
    """Priority-based parameter propagation over a colocated sharded parameter server (mpicomm.sliced_ps).

    The exchange of a step runs on a progress thread; `step()` returns at once
    and each layer waits only for its own slices, in its next forward pass
    (`deferred`). Slice priorities follow the forward order learned from the
    first forward pass (set_priorities). Slice size and credit left "auto"
    are chosen from the link measured when wrapping (runtime.p3.tuning;
    `tuning` says what was chosen and why); credit "online" starts there and
    keeps the fastest of a few tried over the first steps (`trials`).
    """

    name = "p3"
    deferred = True
    progress_thread = True
    carries_buffers = True

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        o, flats = ctx.options, self.buffers.flats
        itemsize = max((b.element_size() for b in flats), default=4)
        aggregate, window = getattr(o, "node_aggregation", True), getattr(o, "node_window", True)
        # Through the window nothing is paced; where it cannot be had, no shared memory either (node_window)
        paced = aggregate and not window and getattr(o, "node_pacing", True) and len(ctx.topology.nodes) > 1
        per_node = max(map(len, ctx.topology.nodes)) if paced else 1  # 1: nothing paced
        self.tuning = t = tune(ctx.topology.world, sum(b.numel() * b.element_size() for b in flats), itemsize,
                               o.slice_size, o.credit, ranks_per_node=per_node)
        if self.timeline:
            self.timeline.instant("p3 tuning", "setup", settings=t.describe(itemsize))
        # The module buffers' vector, when offered, is one tensor more of the exchange: a flat buffer of its own.
        exchanged, segments, names = list(flats), list(self.buffers.segments), list(ctx.names)
        self.carried = None if ctx.carried is None else len(segments)  # its tensor index
        if ctx.carried is not None:
            exchanged.append(ctx.carried)
            segments.append((len(flats), 0, ctx.carried.numel()))
            names.append("module buffers")
        self.exchange = SlicedExchange(ctx.topology.world, exchanged, segments, t.slice_size, t.credit,
                                       self.timeline, names, relaxed_sleep=t.relaxed_sleep,
                                       nodes=ctx.topology.nodes, node_aggregation=aggregate,
                                       local_rate=t.local_rate, node_window=window)
        self.progress = ProgressThread("mpitrain-p3", setup=device_setup(self.buffers.device))  # copies back
        self.exchange.nudge = self.progress.nudge
        self.copy_back = SliceCopyBack(self.exchange.plan.slices, [b.element_size() for b in exchanged],
                                       self._send_back)
        self.exchange.on_done = self._averaged
        # credit="online": the credit of each step from the trials' schedule, then the fastest (online_credit).
        self.trials = CreditTrials(t.credit) if t.online else None
        self.begun = self.timed = 0  # exchanges begun and agreements in: one each a step, in order
        self.future = None  # the exchange of the newest step on the progress thread
        self._open = False  # gradients of the current step are being handed over
        self.yield_link = getattr(o, "yield_link", False)
        self._hold_token = None  # the hold's span on the timeline
        self._carried_in = False  # the buffers' vector handed to the step in flight, not yet waited for

    def set_priorities(self, priority: list[int]) -> None:
        if self.carried is not None:  # needed before the first layer runs: ahead of every gradient
            priority = [*priority, min(priority, default=0) - 1]
        self.exchange.set_priorities(priority)

    def hold(self) -> None:
        # The next forward waits for the step's agreement and the buffers' average: behind `credit` slices at each
        # of their steps that cross the link (a queue of ~8 ms: IN_FLIGHT_SECONDS), Rabenseifner's 2 log2 P steps
        # wait longest. The agreement alone (VGG-19, no buffers) gains less than the link idles for (simulated:
        # benchmarks/claims.md, seventeenth pass), so the wrapper holds only where MPI's allreduce averages the
        # buffers (buffers this exchange carries need no hold).
        if self.yield_link and not self.exchange.holding:
            self.exchange.holding = True
            if self.timeline:
                self._hold_token = self.timeline.begin("hold: the step's collectives first", "p3", track="push")

    def release(self) -> None:
        if self.exchange.holding:
            self.exchange.holding = False
            self.progress.nudge()  # what the hold kept back goes now, not after a relaxed sleep
            if self._hold_token is not None:
                self.timeline.end(self._hold_token)
                self._hold_token = None

    def _started(self) -> SlicedExchange:
        ex = self.exchange
        if not self._open:
            self.release()  # the next step's backward has begun: what its first gradients need must go
            if self.future is not None:
                # The previous step reuses these buffers until it is over (usually it is: every
                # layer waited for its slices in forward; a layer skipped this time did not).
                fut = self.future
                wait_until(lambda: fut.wait_done(0.05), what="the previous p3 step", blocking=True,
                           policy=self.ctx.policy, who=f"rank {ex.rank}: ", interrupt=self.ctx.interrupt,
                           report=lambda: ex.report(range(len(self.params))))
                fut.wait()
            self.copy_back.reset()
            self._carried_in = False  # the previous step is over: its buffers' average is in the vector
            if self.trials is not None:
                self._set_credit(self.trials.credit_for(self.begun))
            self.begun += 1
            self.future = self.progress.submit(ex.begin())
            self._open = True
        return ex

    def _set_credit(self, credit: int) -> None:
        if credit != self.exchange.credit:
            self.exchange.set_credit(credit)
            if self.timeline:
                self.timeline.instant(f"p3 credit {credit}", "setup")

    def step_time(self, seconds: float) -> None:
        trials, self.timed = self.trials, self.timed + 1
        if trials is not None and trials.chosen is None:
            trials.observe(self.timed - 1, seconds)  # the n-th agreement is that of the n-th exchange begun
            if trials.chosen is not None and self.timeline:
                self.timeline.instant("p3 credit chosen", "setup", settings=trials.describe())

    def grad_ready(self, i: int) -> None:
        self._started().ready(i)

    def carry_ready(self) -> None:
        """The module buffers' vector is packed for this step (runtime.model_buffers.BufferSync.hand_over)."""
        self._started().ready(self.carried)
        self._carried_in = True

    def wait_carried(self) -> None:
        """The vector holds the average over ranks of what each rank handed over last."""
        if self._carried_in:
            self.wait([self.carried])
            self._carried_in = False

    def _averaged(self, s: int, tensors: list[int]) -> None:
        """On the progress thread: slice s is averaged (completing `tensors`); staged, its copy back is due."""
        if self.carried is not None and self.exchange.plan.slices[s][0] == len(self.buffers.flats):
            return  # the buffers' vector: read where it is, on the host
        if self.on_averaged is not None:
            self.copy_back(s, tensors)

    def _send_back(self, tensors: list[int], ranges) -> None:
        self.on_averaged(tensors, ranges)

    def finish(self, used, full: bool = False) -> None:
        self._started()
        self._open = False

    def averaged(self):
        """Per parameter, whether its average of the current step is in .grad already (a bool array, read-only)."""
        return self.exchange.tensor_done[:len(self.params)]

    def landing(self, indices) -> list[int]:
        if self._open or self.future is None:  # a step begun has waited for the one before (_started)
            return []
        done = self.exchange.tensor_done
        return [i for i in indices if not done[i]]

    def wait(self, indices) -> None:
        self.release()  # a wait for slices must not wait on the hold
        if self.future is None:
            return
        self.exchange.wait(indices, self.ctx.policy, self.ctx.interrupt)
        if self.future.done():
            self.future.wait()  # re-raises an error of the progress thread
            self.future = None

    def abort(self) -> None:
        self.progress.abort()  # first: no poll may run while the requests are cancelled
        self.exchange.abort()
        self.copy_back.reset()
        self.future, self._open, self._carried_in = None, False, False

    def close(self) -> None:
        self.progress.stop()
        self.exchange.free()
