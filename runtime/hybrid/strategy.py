"""The hybcomm strategy: per Linear layer, sufficient factors or a ring allreduce, the rest through wfbp or p3."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
import zlib

import numpy as np
from mpi4py import MPI

from mpicomm import Collectives
from mpicomm.agree import check_same_structure
from mpicomm.progress import HandlesTask, HandleTask, ProgressThread
from mpicomm.stall import wait_until

from ..dense import WfbpSync
from ..device.threads import device_setup
from ..emulate.accelerator import active as emulated_accelerator
from ..p3 import P3Sync
from ..strategy import Strategy, StrategyContext
from . import cost_model
from .census import Census, CensusTask
from .factors import FactorExchange
from .layers import fc_layers

DEFAULT_BANDWIDTH = 10e9  # bit/s of a node's link when neither the options nor $MPITRAIN_LINK_BANDWIDTH say
PLANS_KEPT = 64  # plans cached by their rows per layer


# The dense path's classes, by the names HybCommOptions.dense accepts (the registry imports this module).
DENSE_CLASSES = {"wfbp": WfbpSync, "p3": P3Sync}


class HybCommSync(Strategy):
    """Poseidon's hybrid communication, wait-free.

    Eligible Linear layers (runtime.hybrid.layers) are handled here, every
    other gradient by the dense strategy (`options.dense`: wfbp or p3) over
    the front of the gradient buffers (`layout` puts the layers' weights and
    biases last). Per step:

    1. forward: each factor layer counts its rows and uses (`forwarded`);
    2. the step's first gradient posts the census (every rank's rows, uses
       and a fingerprint of its cost-model inputs, runtime.hybrid.census),
       completed on the progress thread; then the plan for the agreed rows
       (the most any rank has; cost_model.plan, cached per rows) is made;
    3. as a layer's weight and bias gradients are ready (or, if earlier, as
       the plan is made) it is sent the way the plan says: SFB gathers every
       rank's input and output-gradient rows and rebuilds the averaged
       gradient from them (runtime.hybrid.factors); PS reduces the layer's
       gradient on a ring. Both finish on the progress thread while backward
       goes on. A layer used twice in one forward pass goes PS (its factors
       would be twice as many), said once.
    """

    name = "hybcomm"
    progress_thread = True

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        o = ctx.options
        self.rank = ctx.topology.rank
        layers, refused, fc_params = _factor_layers(ctx.model, ctx.params)
        self.layers = layers
        self.layer_params = fc_params  # per layer: [weight index, bias index?]
        self.layer_of = {i: k for k, idxs in enumerate(fc_params) for i in idxs}
        self.rest = [i for i in range(len(self.params)) if i not in self.layer_of]
        self.inner_index = {i: j for j, i in enumerate(self.rest)}
        self.inner = None
        if self.rest:
            sub = dataclasses.replace(ctx, params=[self.params[i] for i in self.rest],
                                      names=[ctx.names[i] for i in self.rest], buffers=self.buffers.subset(self.rest),
                                      options=o.dense_options())
            self.inner = DENSE_CLASSES[o.dense](sub)
        self.deferred = bool(self.inner and self.inner.deferred)  # p3: a layer's update waits for its forward
        try:
            self.progress = getattr(self.inner, "progress", None) or \
                ProgressThread("mpitrain-hybcomm", drive=ctx.compute_off_host, setup=device_setup(self.buffers.device))
            self.ring = Collectives(ctx.topology, validate=False)  # the PS path's allreduce; factors' allgathers
            self.census = Census(ctx.topology.world, len(layers), lambda: repr(self.links))
            self.links = self._links(o)
        except BaseException:
            self.abort()
            raise
        self.capture = [layer.module for layer in layers]
        self.exchanges = [FactorExchange(layer.name, layer.M, layer.N, layer.module.weight.dtype, 3 * k + 1)
                          for k, layer in enumerate(layers)]
        self.buckets = [self._bucket(idxs) for idxs in fc_params]
        self.plan: list[cost_model.LayerCost] | None = None
        self.plan_version = 0
        self._plans: dict = {}
        self.traffic = {"sfb": 0, "ps": 0}  # elements this rank put on each path, all steps together
        self.futures: list = [None] * len(layers)
        self.lock = threading.Lock()  # layers start from the training thread or, once planned, the progress thread
        self.census_future = None
        self._said: set[str] = set()
        self._new_step()
        if self.rank == 0:
            for name, why in refused.items():
                self._notice(f"{name} goes through {o.dense}: {why}")
            if not layers:
                self._notice(f"no Linear layer can send sufficient factors: hybcomm is {o.dense} for this model")

    # -- set-up ----------------------------------------------------------------
    @classmethod
    def layout(cls, params, options, model=None) -> list[int]:
        """The dense path's parameters first (in its own order), then each factor layer's weight and bias."""
        _, _, fc_params = _factor_layers(model, params)
        taken = {i for idxs in fc_params for i in idxs}
        rest = [i for i in range(len(params)) if i not in taken]
        inner = DENSE_CLASSES[options.dense].layout([params[i] for i in rest], options.dense_options())
        ordered = [rest[j] for j in inner] if inner is not None else rest
        return ordered + [i for idxs in fc_params for i in idxs]

    def _bucket(self, idxs):
        """A factor layer's gradients as one contiguous slice (the PS path reduces it in one allreduce)."""
        segs = [self.buffers.segments[i] for i in idxs]
        b, lo, hi = segs[0][0], min(s[1] for s in segs), max(s[2] for s in segs)
        if any(s[0] != b for s in segs) or hi - lo != sum(s[2] - s[1] for s in segs):
            raise ValueError("hybcomm: a layer's weight and bias must share a dtype")
        return self.buffers.flats[b][lo:hi]

    def _links(self, o) -> cost_model.Links:
        """The cost model's rates, the same on every rank (bandwidths compared, GEMM rate the slowest rank's)."""
        bandwidth = o.bandwidth
        env = os.environ.get("MPITRAIN_LINK_BANDWIDTH")
        if bandwidth is None and env:
            from mpicomm.emulation.netns import parse_bandwidth
            try:
                bandwidth = parse_bandwidth(env)
            except ValueError as exc:
                raise ValueError(f"MPITRAIN_LINK_BANDWIDTH={env!r}: {exc}") from None
        bandwidth = float(bandwidth or DEFAULT_BANDWIDTH)
        check_same_structure(self.ctx.topology.world, [f"hybcomm link bandwidth {bandwidth:g} bit/s"], "setting")
        if o.gflops is not None or o.force != "auto" or not self.layers:
            gflops = float(o.gflops or math.inf)
        else:
            acc = emulated_accelerator()
            if acc is None:
                self.ctx.topology.world.Barrier()  # every rank at work at once: the rate a step will see
                mine = np.array([cost_model.measure_gflops()])
            else:  # the rebuild runs on the emulated device: its modelled rate, not this host's
                mine = np.array([cost_model.emulated_gflops(acc)])
            self.ctx.topology.world.Allreduce(MPI.IN_PLACE, mine, op=MPI.MIN)
            gflops = float(mine[0])
        return cost_model.Links(inter_bps=bandwidth, intra_bps=float(o.intra_bandwidth), gflops=gflops)

    # -- what the wrapper calls --------------------------------------------------
    def set_priorities(self, priority: list[int]) -> None:
        if self.inner is not None:
            self.inner.set_priorities([priority[i] for i in self.rest])

    def forward_started(self) -> None:
        self.passes += 1

    def forwarded(self, k: int, inputs) -> None:
        self.uses[k] += 1
        self.rows[k] += inputs.numel() // self.layers[k].M

    def captured(self, k: int, inputs, grad_output) -> None:
        # In the layer's output-gradient hook: the rows go to the host here, on the thread and stream that
        # produced them, unless the layer will likely go PS (then start() copies them if this step's plan
        # says SFB after all).
        self.exchanges[k].add(inputs, grad_output, self.rows[k], self._factors_likely(k))

    def _factors_likely(self, k: int) -> bool:
        """Whether layer k will send factors this step, as far as backward can know: what the last plan said."""
        plan = self.plan
        if plan is not None:
            return plan[k].choice == "sfb"
        return self.ctx.options.force != "ps"

    def grad_ready(self, i: int) -> None:
        if not self.posted and self.layers:
            self._post_census()
        k = self.layer_of.get(i)
        if k is None:
            self.inner.grad_ready(self.inner_index[i])
            return
        self.left[k] -= 1
        if self.left[k] == 0:
            with self.lock:
                if self.round.planned:
                    self._start(k)
                else:
                    self.round.waiting.append(k)

    def _post_census(self) -> None:
        if self.census_future is not None:  # the previous step's, normally complete long ago
            self._wait_futures([self.census_future], "the previous step's census")
            self.census_future = None
        self.posted = True
        self.round = this = _Round()
        self.census.post(self._fingerprint(), self.passes, self.rows, self.uses)
        self.census_future = self.progress.submit(CensusTask(self.census, lambda: self._planned(this)))

    def _planned(self, this: "_Round") -> None:
        """On the progress thread: the census is in, so plan and start the layers that were waiting for it."""
        with self.lock:
            self._replan()
            this.planned = True
            for k in this.waiting:
                self._start(k)
            this.waiting = []

    def finish(self, used, full: bool = False) -> None:
        if self.inner is not None:
            self.inner.finish(None if used is None else np.asarray(used)[self.rest], full)  # None: p3's
        self._new_step()

    def wait(self, indices) -> None:
        inner, mine = [], set()
        for i in indices:
            k = self.layer_of.get(i)
            if k is None:
                inner.append(self.inner_index[i])
            else:
                mine.add(k)
        if inner:
            self.inner.wait(inner)
        if not mine:
            return
        if self.census_future is not None:  # it starts the layers that waited for the plan
            self._wait_futures([self.census_future], "hybcomm's census of this step")
        pending = [self.futures[k] for k in mine if self.futures[k] is not None]
        self._wait_futures(pending, "hybcomm's factor layers",
                           lambda: f"layers {[self.layers[k].name for k in mine if self.futures[k] is not None]} "
                                   f"wait on the ring (left neighbour: rank {self.ring.left})")
        for k in mine:
            self.futures[k] = None

    def landing(self, indices) -> list[int]:
        # A factor layer no rank ran sends nothing (K = 0); one that any rank ran is owed, and waited for.
        if self.inner is None:
            return []
        return [self.rest[j] for j in self.inner.landing([self.inner_index[i] for i in indices
                                                            if i not in self.layer_of])]

    def _wait_futures(self, futures, what: str, report=lambda: "a rank has not handed over its gradients") -> None:
        if futures:
            with self.progress.driven():
                wait_until(lambda: all(f.wait_done(0.05) for f in futures), what=what, policy=self.ctx.policy,
                           blocking=True, who=f"rank {self.rank}: ", interrupt=self.ctx.interrupt, report=report)
            for f in futures:
                f.wait()  # re-raises an error of the progress thread

    def local_problem(self) -> str | None:
        return self.inner.local_problem() if self.inner is not None else None

    def step_time(self, seconds: float) -> None:
        if self.inner is not None:
            self.inner.step_time(seconds)  # p3's online credit

    @property
    def trials(self):
        return getattr(self.inner, "trials", None)

    def plan_text(self) -> str:
        return cost_model.format_plan(self.plan) if self.plan else "(no plan yet: it is made in the first step)"

    # -- one layer ---------------------------------------------------------------
    def _start(self, k: int) -> None:
        """Send layer k the way the plan says (the lock held, the census in)."""
        how = self.plan[k]
        tl, layer = self.timeline, self.layers[k]
        rows = self.census.rows(k)
        if how.K == 0:  # no rank ran the layer: nothing to average (its gradient is zero everywhere)
            self.exchanges[k].drop()
            return
        token = tl.begin(f"{how.choice} {layer.name}", "sync", track="comm", layer=layer.name,
                         rows=int(sum(rows))) if tl else None
        idxs = self.layer_params[k]
        size = self.size
        if how.choice == "sfb":
            ex = self.exchanges[k]
            grad_w = self.buffers.views[idxs[0]]
            grad_b = self.buffers.views[idxs[1]] if len(idxs) > 1 else None

            def rebuilt(ex=ex, grad_w=grad_w, grad_b=grad_b, token=token):
                ex.rebuild(grad_w, grad_b, size)
                if tl:
                    tl.end(token)
            task = HandlesTask(ex.start(self.ring, rows, self.rank), rebuilt)
            self.traffic["sfb"] += rows[self.rank] * (layer.M + layer.N)
        else:
            self.exchanges[k].drop()
            bucket = self.buckets[k]

            def averaged(handle, bucket=bucket, token=token):
                bucket.div_(size)
                if tl:
                    tl.end(token)
            task = HandleTask(self.ring.allreduce(bucket, tag=3 * k), averaged)
            self.traffic["ps"] += bucket.numel()
        self.futures[k] = self.progress.submit(task)  # refused after an abort: submit() cancels it

    def _replan(self) -> None:
        """The plan for this step's census: the most rows any rank has per layer, layers used twice to PS."""
        rows = {layer.name: max(self.census.rows(k)) for k, layer in enumerate(self.layers)}
        passes = max(self.census.passes()) or 1
        twice = {layer.name: "used twice in one forward pass" for k, layer in enumerate(self.layers)
                 if max(self.census.uses(k)) > passes}
        key = (tuple(rows.values()), tuple(twice))
        plan = self._plans.get(key)
        if plan is None:
            topo = self.ctx.topology
            plan = cost_model.plan(self.layers, rows, self.size, max(len(n) for n in topo.nodes), self.links,
                                   itemsize=self.layers[0].module.weight.element_size() if self.layers else 4,
                                   force=self.ctx.options.force, ps_only=twice)
            if len(self._plans) >= PLANS_KEPT:  # rows that change every step (sequences): keep the newest
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan
        if plan is not self.plan:
            self.plan = plan
            self.plan_version += 1
            if self.rank == 0:
                for name, why in twice.items():
                    self._notice(f"{name} goes through a ring allreduce, not sufficient factors: {why}")

    def _fingerprint(self) -> int:
        """What this rank's plan is made of besides the census: equal on every rank, or no layer starts."""
        layers = [(layer.name, layer.M, layer.N, layer.has_bias) for layer in self.layers]
        return zlib.crc32(repr((self.links, self.ctx.options.describe(), layers)).encode())

    def _new_step(self) -> None:
        """Counters for the next step's forward; the census of this one may still be completing."""
        self.passes = 0
        self.rows = [0] * len(self.layers)
        self.uses = [0] * len(self.layers)
        self.left = [len(idxs) for idxs in self.layer_params]
        self.posted = False  # the next gradient posts the next census, and opens a new round

    def _notice(self, text: str) -> None:
        """One line on rank 0's stderr, once per distinct text."""
        if text not in self._said:
            self._said.add(text)
            print(f"hybcomm: {text}", file=sys.stderr, flush=True)

    # -- the end ---------------------------------------------------------------
    def abort(self) -> None:
        if self.inner is not None:
            self.inner.abort()  # stops the shared progress thread first
        elif getattr(self, "progress", None) is not None:
            self.progress.abort()
        for fut in getattr(self, "futures", []):
            if fut is not None:
                fut.task.cancel()  # HandleTask or HandlesTask: their collectives are dropped
        if getattr(self, "census", None) is not None:
            self.census.cancel()
        self.futures = [None] * len(self.layers)
        self.census_future = None

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        else:
            self.progress.stop()
        self.ring.free()
        self.census.free()


class _Round:
    """One step's plan: whether the census is in, and the layers that became ready before it was.

    Each step has its own: finish() may open the next step while the last
    census is still completing, and that census must still start its layers.
    """

    __slots__ = ("planned", "waiting")

    def __init__(self):
        self.planned, self.waiting = False, []


def _factor_layers(model, params):
    """(eligible layers, refused {name: why}, per layer the indices of its weight and trainable bias in params)."""
    if model is None:
        return [], {}, []
    index = {id(p): i for i, p in enumerate(params)}
    layers, refused = fc_layers(model)
    kept, idxs = [], []
    for layer in layers:
        w = index.get(id(layer.module.weight))
        if w is None:  # not managed by this optimizer
            continue
        b = index.get(id(layer.module.bias)) if layer.has_bias else None
        kept.append(layer)
        idxs.append([w] if b is None else [w, b])
    return kept, refused, idxs
