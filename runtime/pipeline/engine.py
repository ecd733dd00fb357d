"""Pipeline: a sequential model cut into stages across MPI ranks, trained with 1F1B in one of four weight modes."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mpicomm import Topology, failstop
from mpicomm.agree import check_same_structure
from mpicomm.stall import StallPolicy
from mpicomm.step_check import BARRIER, EVALUATE, EXCHANGE, GATHER, StepCheck, digest

from . import emulation, model_state, partition, schedule, teardown
from .checks import PipelineError, check_arguments, check_same_values, describe_layers, split_batch
from .divergence import DIVERGE_FACTOR, LossWatch
from .host_times import OpTimes
from .placement import PipelineLayout
from .stage_optimizer import stage_optimizer
from .staging import StagedLink
from .transport import StageLink, agree_boundaries, describe
from .versions import WeightVersions, version_difference


class Pipeline:
    """Train a sequential model split into stages over MPI ranks; call train_step on every rank.

        pipe = Pipeline(nn.Sequential(...), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                        loss_fn=F.cross_entropy, stages=4, sample=x[:16], microbatches=8, mode="spectrain")
        for x, y in batches:
            loss = pipe.train_step(x, y)      # inputs used on the first stage, targets on the last
        print(pipe.evaluate(test_x, test_y))  # {'loss', 'accuracy', 'count'} on every rank
        state = pipe.gather_state_dict()      # the whole trained model's state_dict on rank 0
        pipe.close()

    model: nn.Sequential, a list of modules, or an object with pipeline_layers(); every rank
    builds the same one (same seed: checked) and keeps only its stage's layers in use.
    optimizer_factory(params) -> torch optimizer for one stage's parameters.
    balance: layers per stage; or stages=N with sample= (one micro-batch of inputs) to
    partition by measured layer time (and bandwidth=bits/s for the activations' transfer).
    say(text): given the plan's table on world rank 0 (default print; None: not shown).
    microbatches: per train_step; the batch is cut into this many equal micro-batches.
    mode: "flush" (synchronous: gradients of all micro-batches summed, one update per
    step at the optimizer's lr, equal to one process), "vanilla", "stash" (PipeDream) or
    "spectrain" (asynchronous: one update per micro-batch at lr / microbatches, the
    pipeline never drained between steps); spectrain_variant "paper" or "once"
    (runtime.pipeline.versions says what each mode does per micro-batch and per step).
    diverge_factor: a last stage's micro-batch loss that is not finite, or above this
    times the first one's, raises DivergenceError on every rank before its backward
    (None: only a non-finite loss; runtime.pipeline.divergence).
    replicas: copies of each stage (world = stages x replicas) averaging their gradients
    with `data_parallel` ("allreduce" or "wfbp") on a sub-communicator; placement:
    "within-node" or "across-nodes" (runtime.pipeline.placement). Each replica must be
    given its own share of the data: pipe.replica of pipe.replicas.
    Attributes: stage, stages, first, last, replica, replicas, balance, plan (the table, on
    rank 0), layers (the model's, in order) and layer_range (this stage's: layers[a:b]),
    module (this stage's nn.Sequential), optimizer.
    Received activations land in buffers reused every few micro-batches: a tensor hook
    on a stage's input stays on its buffer and fires again for later micro-batches.
    device: "cpu", or "cuda": each rank's stage on GPU local_rank mod the GPUs it sees
    (ranks may share one; "cuda:N" pins it), inputs and targets moved there, boundary
    tensors crossing through pinned host buffers (runtime.pipeline.staging).
    staging: True forces that host-staged transport on the CPU too (tests; also
    MPITRAIN_STAGING=force); None: staged on a GPU only.
    compute: emulated compute (runtime.emulate: a ComputeModel or its spec, "v100"; times x
    compute_scale; needs sample= on every rank): each stage emulated alone at its input's shape, the
    loss emulated_loss, the optimizer emulated, the partition by modelled times (pipeline.emulation).
    """

    def __init__(self, model, optimizer_factory, *, loss_fn, stages: int | None = None, balance=None,
                 microbatches: int = 4, mode: str = "flush", spectrain_variant: str = "paper", replicas: int = 1,
                 placement: str = "within-node", data_parallel: str = "allreduce", sample=None,
                 bandwidth: float | None = None, comm=None, topology: Topology | None = None, timeline=None,
                 stall: StallPolicy | None = None, say=print, record_versions: bool = False, device="cpu",
                 staging: bool | None = None, diverge_factor: float | None = DIVERGE_FACTOR, compute=None,
                 compute_scale: float = 1.0):
        self._own_topology = topology is None
        self.topology = topology or (Topology(comm) if comm is not None else Topology())
        world = self.topology.world
        self.policy = stall or StallPolicy.from_env()
        self.timeline, self.loss_fn, self.mode, self.microbatches = timeline, loss_fn, mode, microbatches
        self.layout = self.check = self.link = self.dopt = None
        self.failed: BaseException | None = None
        self._closed = False
        try:
            layers, self.device, self.staged = check_arguments(
                world, model, stages, balance, microbatches, mode, spectrain_variant, replicas, placement,
                data_parallel, sample, device, staging, self.topology.local_rank, diverge_factor, compute,
                compute_scale)
            n_stages = len(balance) if balance is not None else stages
            settings = [f"mode={mode}", f"spectrain_variant={spectrain_variant}", f"stages={n_stages}",
                        f"balance={'auto' if balance is None else list(balance)}", f"microbatches={microbatches}",
                        f"replicas={replicas}", f"placement={placement}", f"data_parallel={data_parallel}",
                        f"loss_fn={getattr(loss_fn, '__name__', type(loss_fn).__name__)}",
                        f"device={self.device.type}", f"diverge_factor={diverge_factor}",
                        f"compute={emulation.label(compute)} x{compute_scale:g}"]
            check_same_structure(world, settings, "pipeline setting")
            check_same_structure(world, describe_layers(layers), "layer parameter")
            check_same_values(world, layers)
            self.layout = PipelineLayout(self.topology, n_stages, replicas, placement)
            self.stage, self.stages = self.layout.stage, n_stages
            self.replica, self.replicas = self.layout.replica, replicas
            self.first, self.last = self.layout.first, self.layout.last
            self.balance, self.plan = partition.decide(world, layers, balance, n_stages, sample, bandwidth, self.device,
                                                       PipelineError, compute, compute_scale)
            if say is not None and world.Get_rank() == 0:
                say(self.plan)
            a = sum(self.balance[:self.stage])
            self.model, self.layers, self.layer_range = model, layers, range(a, a + self.balance[self.stage])
            # Only this stage's layers go to the device; the caller's model keeps the others where they were.
            self.module = nn.Sequential(*layers[a:a + self.balance[self.stage]]).to(self.device)
            self.acc = None
            if compute is not None:  # before anything hooks into the stage (a replica group's optimizer)
                self.acc, self.loss_fn, wrap = emulation.emulate_stage(world, self.stage, self.module, layers, a,
                                                                       sample, compute, compute_scale)
                optimizer_factory = wrap(optimizer_factory)
            self.ops = OpTimes(self.timeline, (lambda: self.acc.clock) if self.acc is not None else None)
            ends = np.cumsum([0] + self.balance)
            # Gradients flow back across boundary k only if a stage before it has something to train.
            self._trains_before = [any(p.requires_grad for layer in layers[:ends[k]] for p in layer.parameters())
                                   for k in range(self.stages + 1)]
            self.params = [p for p in self.module.parameters() if p.requires_grad]
            self.optimizer, self.dopt = stage_optimizer(world, self.stage, self.params, optimizer_factory, mode,
                                                        self.module, self.layout, self.microbatches, data_parallel,
                                                        self.policy)
            self.in_flight = schedule.warmup(self.stage, self.stages) + 1
            shifts = version_difference(self.stage, self.stages, spectrain_variant) if mode == "spectrain" else (0, 0)
            self.version_log: list | None = [] if record_versions else None
            # The asynchronous modes update per micro-batch at the micro-batch's share of the rate.
            self.versions = WeightVersions(self.params, mode, self.in_flight, self.optimizer, shifts,
                                           once=spectrain_variant == "once", log=self.version_log,
                                           divisor=1 if mode == "flush" else microbatches, acc=self.acc)
            self.watch = LossWatch(diverge_factor, f"stage {self.stage}, replica {self.replica}, rank "
                                                   f"{world.Get_rank()}") if self.last else None
            self.check = StepCheck(world, 0, self.policy)
        except BaseException:
            teardown.release(self)
            raise
        self._settings = digest("\n".join(settings))
        self._next = self._base = 0  # next micro-batch id; first one since the pipeline was last empty
        self._inflight: dict[int, tuple] = {}
        self.steps = 0
        self._meta = None  # [(shape, dtype)] of each stage's output, agreed at the first step
        failstop.register(self)  # its step goes into this rank's failure notice; open at exit is said

    # -- set-up ---------------------------------------------------------------------------
    def _setup_link(self, first_input) -> None:
        """First step: every boundary's shape and dtype agreed along the pipeline, buffers allocated."""
        def produce(in_meta):
            with torch.no_grad():
                x = first_input if in_meta is None else torch.zeros(in_meta[0], dtype=in_meta[1], device=self.device)
                return self.module(x)
        self._input_meta = (tuple(first_input.shape), first_input.dtype) if self.first else None
        self._meta = agree_boundaries(self.layout.pipeline, self.stage, produce, self.device.type)
        in_meta = self._meta[self.stage - 1] if not self.first else None
        kind = dict(device=self.device) if self.staged else {}
        self.link = (StagedLink if self.staged else StageLink)(
            self.layout.pipeline, self.stage, in_meta, self._meta[self.stage], self.in_flight,
            interrupt=self._interrupt, policy=self.policy, timeline=self.timeline, **kind)
        # No gradient crosses a boundary carrying integers (token ids), nor one with nothing to train before it.
        self._grad_in = in_meta is not None and in_meta[1].is_floating_point and self._trains_before[self.stage]
        self._grad_out = not self.last and self._meta[self.stage][1].is_floating_point and \
            self._trains_before[self.stage + 1]

    # -- training ----------------------------------------------------------------------------
    def train_step(self, inputs=None, targets=None) -> float | None:
        """One step of `microbatches` micro-batches; the mean loss on the last stage, None elsewhere."""
        self._usable()
        try:
            self._round(EXCHANGE)
            xs = split_batch(inputs, "inputs", self.stage, self.microbatches, self.device) if self.first else None
            ys = split_batch(targets, "targets", self.stage, self.microbatches, self.device) if self.last else None
            if self.link is None:
                self._setup_link(xs[0] if self.first else None)
            elif self.first and (tuple(xs[0].shape), xs[0].dtype) != self._input_meta:
                raise ValueError(f"inputs of micro-batch shape {describe(xs[0].shape, xs[0].dtype)}, but the "
                                 f"pipeline was set up for {describe(*self._input_meta)} at its first step")
            if self.last:
                self.watch.new_step()
            first = self._next
            ops = list(schedule.step_ops(self.stage, self.stages, first, self.microbatches, self._base))
            if self.mode == "flush":
                ops += schedule.drain_ops(self.stage, self.stages, first + self.microbatches, self._base)
            for op, i in ops:
                if op == schedule.FORWARD:
                    k = i - first
                    self._forward(i, xs[k] if xs else None, ys[k] if ys else None)
                else:
                    self._backward(i)
            self.link.post_sends()
            self._next += self.microbatches
            if self.mode == "flush":
                self._base = self._next
                self._update()
            self.steps += 1
            if not self.last:
                return None
            return self.watch.mean(self.steps)
        except BaseException as exc:
            raise self._fail(exc)

    def _forward(self, i: int, x, target) -> None:
        if not self.first:
            x = self.link.activation(i)
            if self._grad_in and not x.requires_grad:
                x.requires_grad_()
        with self.ops.op("F", f"F{i}", "forward"):  # not the send after it: its host time is the link's own
            with self.versions.forward(i % self.in_flight, i):
                out = self.module(x)
            if self.last:
                loss = self.loss_fn(out, target)
                self.watch.add(loss)
                if self.dopt is not None:  # its gradients may reach the other replicas during the backward
                    self.watch.read(self.steps + 1)
                out = loss / self.microbatches if self.mode == "flush" else loss
        if not self.last:
            self.link.send_activation(i, out)
        self._inflight[i] = (x, out)

    def _backward(self, i: int) -> None:
        x, out = self._inflight.pop(i)
        grad = self.link.gradient(i) if self._grad_out else None
        with self.ops.op("B", f"B{i}", "backward"), self.versions.backward(i % self.in_flight, i):
            if out.requires_grad:
                torch.autograd.backward(out, grad)
        if self.last:
            # Read once the backward is queued (the device computes it meanwhile), before its gradient is
            # sent or applied: a diverged loss is never applied, here or on another stage.
            self.watch.read(self.steps + 1)
        if self._grad_in:
            self.link.send_gradient(i, x.grad if x.grad is not None else torch.zeros_like(x))
            x.grad = None
        self.link.release(i)
        if self.mode != "flush":
            self._update()

    def _update(self) -> None:
        # flush: lr; the asynchronous modes: lr / microbatches
        with self.ops.op("U", f"U{self.versions.updates}", "update"), self.versions.applied_lr():
            if self.dopt is not None:
                self.dopt.step()
                self.dopt.zero_grad()
            else:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)  # in place: no new gradient tensors every update
        self.versions.updates += 1

    def drain(self) -> None:
        """Finish every backward still owed (asynchronous modes), so the weights are those of all steps so far."""
        self._usable()
        if self.link is None or self._base == self._next:
            return
        try:
            for _, j in schedule.drain_ops(self.stage, self.stages, self._next, self._base):
                self._backward(j)
            self.link.post_sends()
            self._base = self._next
        except BaseException as exc:
            raise self._fail(exc)

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self, inputs=None, targets=None, batch_size: int = 256) -> dict:
        """Loss and accuracy (argmax over the last dimension) of the current weights, on every rank of this pipeline.

        Collective: every rank of the pipeline's world calls it, with the same batch_size (agreed first)."""
        from .evaluation import evaluate

        self._usable()
        try:
            # Agreed before the drain's and the batches' messages: each stage sizes its receives from its own
            # batch_size (ranks that differ: a truncated receive on one rank, a wait on its neighbour), and a rank
            # still training is named rather than waited for. A bad value is refused after the round, which every
            # rank then has left: none raises while another still waits in its last step.
            self._round(EVALUATE, f"batch_size={batch_size!r}")
            self.check.finish()
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(f"evaluate(): batch_size must be a whole number >= 1, got {batch_size!r}")
        except BaseException as exc:
            raise self._fail(exc)
        self.drain()
        try:
            return evaluate(self, inputs, targets, batch_size)
        except BaseException as exc:
            raise self._fail(exc)

    def barrier(self) -> None:
        """Every rank of the pipeline's world gets here (collective); a rank that failed makes it raise, never hang."""
        self._usable()
        try:
            self._round(BARRIER)
            self.check.finish()
        except BaseException as exc:
            raise self._fail(exc)

    def gather_state_dict(self, root: int = 0) -> dict | None:
        """The whole trained model's state_dict on world rank `root`, None elsewhere (collective; drains first).

        Keys as the given model's state_dict(); on `root` that model holds the
        trained weights too (runtime.pipeline.model_state.gather_state_dict).
        """
        self.drain()
        try:
            self._round(GATHER)
            self.check.finish()
            return model_state.gather_state_dict(self, root)
        except BaseException as exc:
            raise self._fail(exc)

    # -- agreement, failure, end --------------------------------------------------------------
    def _round(self, action: int, setting: str = "") -> None:
        """Start the agreement round of `action`; `setting` ("name=value"), this call's own, must match too."""
        if self.check.pending:
            self.check.finish()
        if setting:
            self.check.start(action, self.steps, digest(setting), describe=lambda: [setting])
        else:
            self.check.start(action, self.steps, self._settings)

    def _interrupt(self) -> None:
        """Called in every wait: another rank's failure, or an agreement round showing ranks out of step."""
        self.check.interrupt()
        if self.check.ready():
            self.check.finish()

    def _usable(self) -> None:
        if self._closed:
            raise RuntimeError("this Pipeline was closed")
        if self.failed is not None:
            raise RuntimeError(f"this Pipeline stopped after an error: {self.failed}")

    def _fail(self, exc: BaseException) -> BaseException:
        return teardown.fail(self, exc)

    def abort(self, exc: BaseException) -> None:
        """This rank stops with `exc` (a caught ^C, say): the other ranks raise PeerFailedError in their waits,
        nothing more is agreed, and state_dict() stays this rank's own to save. Then closed."""
        teardown.abort(self, exc)

    def send_times(self, clear: bool = False) -> dict[str, list[float]]:
        """Host seconds of each of this stage's sends since the last clear, by direction ("act", "grad"): the
        copy out of a stage's output and the Isend; clear: start anew (a benchmark's timed window)."""
        return self.link.send_times(clear) if self.link is not None else {"act": [], "grad": []}

    def op_times(self, clear: bool = False) -> dict[str, list[float]]:
        """Host seconds of each of this stage's forwards, backwards and updates since the last clear ("F", "B",
        "U"), beyond its emulated device's sleeps (host_times.OpTimes); clear: start anew."""
        return self.ops.times(clear)

    def stats(self) -> dict:
        """Counters: bytes and messages this rank sent to neighbouring stages, updates, weight copies held, and
        host_waits: the times training waited for the device (loss reads, staged copies)."""
        link_waits = sum(c.host_waits for c in (self.link.inbound, self.link.outbound)) \
            if isinstance(self.link, StagedLink) else 0
        return dict(stage=self.stage, device=str(self.device), bytes_sent=self.link.bytes_sent if self.link else 0,
                    messages_sent=self.link.messages_sent if self.link else 0, updates=self.versions.updates,
                    weight_copy_bytes=self.versions.held_bytes(),
                    parameter_bytes=sum(p.numel() * p.element_size() for p in self.params),
                    host_waits=(self.watch.reads if self.watch else 0) + link_waits)

    def state_dict(self) -> dict:
        """This stage's weights and optimizer state, and its layers (drain() first in an asynchronous mode).

        Keys of "module": this stage's layers as an nn.Sequential ("0.weight" is
        layers[layer_range.start]); runtime.pipeline.load_stages puts every
        stage's state into one model.
        """
        return model_state.stage_state(self)

    def load_state_dict(self, state: dict) -> None:
        model_state.load_stage_state(self, state)

    def close(self) -> None:
        """Drain, agree that every rank got here after as many steps, release everything (collective)."""
        teardown.close(self)

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.abort(exc)
        else:
            self.close()

