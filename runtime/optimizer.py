"""DistributedOptimizer: wrap any torch optimizer so gradients are averaged over MPI ranks with a chosen strategy."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch

from mpicomm import Topology, failstop
from mpicomm.stall import StallError, StallPolicy
from mpicomm.step_check import CHECKPOINT, StepCheck, digest

from . import checkpoint, metrics, stepping, teardown
from .comm_hooks import install_hook
from .deferred import DeferredUpdates
from .emulate.accelerator import device_work
from .frozen_watch import FrozenWatch
from .device import describe_transport, gradient_hook, gradient_staging, model_device, staging_wanted
from .grad_buffers import GradientBuffers
from .model_buffers import BufferSync
from .options import StrategyOptions, resolve
from .p3.forward_gate import ForwardGate
from .registry import strategy_class
from .startup import broadcast_from_root, check_arguments, check_settings
from .strategy import StrategyContext, capture_hooks
from .updates import ParamUpdater


class DistributedOptimizer:
    """Synchronous data-parallel SGD over MPI; the training loop stays as it was.

        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, "p3")
        for x, y in batches:                 # every rank calls step() equally often
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        opt.close()

    strategy: a name ("allreduce", "wfbp", "p3", "topk", "hier-topk", "hybcomm") or an options
    object (runtime.options). Wrapping is collective: every setting and the model's structure are
    compared across ranks (an error names ranks and values), and rank 0's parameters, buffers and
    optimizer state are broadcast. Every step agrees across ranks on the step number and the
    hyper-parameters, so a rank that steps more often, closes early, fails or trains with another
    learning rate stops every rank with an error instead of a hang or silent drift.

    - comm / topology: the ranks to train on (default MPI.COMM_WORLD; a
      communicator is duplicated, never used directly);
    - pto: each rank updates 1/P of the parameters (runtime.pto);
    - backward_passes_per_step: gradient accumulation (Horovod's); `no_sync()`
      is DDP's form of it;
    - buffers: "average" (default), "broadcast" or "none" for module buffers
      such as BatchNorm statistics (runtime.model_buffers);
    - stall: runtime.StallPolicy, how long a wait may take before a stall
      report and a StallError naming what is missing.

    Gradients live in flat per-dtype buffers that .grad views (zero_grad() zeroes them in place rather
    than setting None; the wrapped optimizer's own zero_grad() comes here until close(), and its own step()
    is refused). Parameters no rank produced a gradient for in a step are not updated, as with one process.

    A model on a GPU (model.cuda() before wrapping; one device per rank, ranks may share a GPU) trains
    unchanged: gradients go to pinned host memory on a side CUDA stream a bucket at a time as backward
    finalises them, MPI averages them there while the GPU goes on, and each average returns on a side
    stream as its exchange completes (runtime.device.staging; `transport` says which path runs). The
    sparse strategies select on the GPU and move (index, value) pairs.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 strategy: str | StrategyOptions = "p3", *, comm=None, topology: Topology | None = None,
                 pto: bool = False, backward_passes_per_step: int = 1, buffers: str = "average",
                 timeline=None, stall: StallPolicy | None = None):
        self.options = resolve(strategy)
        cls = strategy_class(self.options.name)  # before the collective Topology: an unknown one leaks nothing
        check_arguments(backward_passes_per_step, comm, topology, buffers)
        self.optimizer, self.model, self.timeline = optimizer, model, timeline
        self.policy = stall or StallPolicy.from_env()
        self._own_topology = topology is None
        self.topology = topology or (Topology(comm) if comm is not None else Topology())
        self.comm = self.topology.world
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.frozen = FrozenWatch(model)
        self.params = [p for _, p in named]
        self.names = [n for n, _ in named]
        self.bpps, self.pto_enabled, self.buffer_mode = backward_passes_per_step, bool(pto), buffers
        try:
            self.device = model_device(self.names, self.params)
            # A host mirror of the gradients for MPI; the optimizer copies through it unless the
            # strategy works on the device itself (sparse: it moves only pairs, via the mirror as scratch).
            self.staged = staging_wanted(self.device)
            settings = [f"strategy {self.options.describe()}", f"pto={self.pto_enabled}",
                        f"backward_passes_per_step={self.bpps}", f"buffers={self.buffer_mode}",
                        f"device {self.device.type}, staged={self.staged}"]
            check_settings(self.comm, settings, model, optimizer)
            self._build(cls, pto)
        except BaseException:
            if getattr(self, "check", None) is not None:
                self.check.stop_listening()  # its beacon receive is posted already
            teardown.release_topology(self)
            raise
        n = len(self.params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._used = np.zeros(n, dtype=bool)  # this rank produced a gradient this step
        self._passes = [0] * n  # backward passes that reached each parameter this step
        self._sent = [False] * n
        self.deferred = DeferredUpdates(self._wait, self.updater, self.buffers, timeline,
                                        getattr(self.strategy, "averaged", None), self.strategy.landing)
        self._open = self._zeroed_open = False  # a backward pass of the current step has run; zero_grad() since
        self._synchronized = False  # synchronize() averaged this step's gradients already
        self._no_sync, self._update_mask = False, None
        self._owed_early = False  # the step's updates owed before its agreement was in (runtime.stepping)
        self._stepped_at = None  # perf_counter() at the last step()'s agreement (runtime.stepping)
        self.steps, self._closed = 0, False
        self.failed: BaseException | None = None
        on_grad = gradient_hook(self._on_grad, self.staging)
        self._hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in self.params]
        self.gate = ForwardGate(model, self.params, self._on_module_enter) if self.strategy.deferred else None
        self._forward_hook = model.register_forward_pre_hook(self._before_forward) \
            if self.model_buffers.active else None
        self._state_hook = model.register_state_dict_pre_hook(lambda *a: self._before_reading())
        # Loading weights mid-run (a best model kept aside, a checkpoint): owed updates land first, or p3's next
        # forward would apply them on top of what was just loaded.
        self._load_hook = model.register_load_state_dict_pre_hook(lambda *a: self._before_reading())
        self._capture_hooks = capture_hooks(self.strategy)
        # Users' loops often call zero_grad() on the optimizer they made rather than on this wrapper: routed
        # here while wrapped, it neither drops an average that a deferred (p3) update still owes nor replaces
        # the .grad views of the buffers.
        self._unroute_zero_grad = route_zero_grad(optimizer, self.zero_grad)
        self._step_guard = self.updater.guard_step(type(self).__name__)  # and its own step() refused
        failstop.register(self)  # its step goes into this rank's failure notice; open at exit is said

    # -- set-up --------------------------------------------------------------
    def _build(self, cls, pto: bool) -> None:
        """Everything collective after the settings agreed: the same calls, in the same order, on every rank."""
        broadcast_from_root(self.comm, self.model, self.optimizer)
        self.options = cls.settle(self.options, self.topology, self.params)  # "auto" that the layout follows
        self.buffers = GradientBuffers(self.params, self.names, cls.layout(self.params, self.options, self.model),
                                       staged=self.staged)
        self.updater = ParamUpdater(self.optimizer, self.params)
        self.pto = None
        if pto:  # first: a refusal (mixed dtypes, a parameter it cannot place) leaves nothing half-built
            from .pto import ShardedUpdate

            self.pto = ShardedUpdate(self.optimizer, self.params, self.comm, topology=self.topology)
            self.pto.load_from(self.optimizer)
            self.optimizer.state.clear()  # the pieces hold the state now: 1/P of it per rank
        self.moved_momentum = cls.adopt_momentum(self.optimizer, self.options)
        self._comm_hook = None
        self.check = StepCheck(self.comm, len(self.params), self.policy, watch=cls.progress_thread)
        self.model_buffers = BufferSync(self.model, self.comm, self.buffer_mode, self.policy,
                                        self.check.interrupt, timeline=self.timeline)
        carried = self.model_buffers.vector if cls.carries_buffers and self.model_buffers.carryable else None
        ctx = StrategyContext(self.topology, self.params, self.names, self.buffers, self.options, self.timeline,
                              self.policy, shard_gradients=pto and cls.can_shard_gradients,
                              momentum=self.moved_momentum, model=self.model, interrupt=self.check.interrupt,
                              carried=carried)
        self.strategy = cls(ctx)
        if carried is not None:
            self.model_buffers.carry(self.strategy)
        self.staging = gradient_staging(self.buffers, self._deliver, self.check.interrupt, self.timeline, cls.on_device,
                                        self.strategy.staging_groups())
        if self.staging is not None and self.pto is None:  # copies back as averaged (PTO reads the host shard)
            self.strategy.on_averaged = self.staging.averaged
        self.transport = describe_transport(self.device, self.staged, cls.on_device, self.strategy.drives)
        if self.timeline:
            self.timeline.instant("gradient transport", "setup", transport=self.transport)

    def register_comm_hook(self, state, hook) -> None:
        """DDP-style hook (runtime.comm_hooks), called for each bucket instead of the plain average."""
        self._comm_hook = install_hook(self.strategy, state, hook, started=bool(self.steps or self._open))

    # -- hooks ---------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if self.failed is not None:
            return
        i = self._index[id(p)]
        stepping.settle(self, fresh=(i,), wait=False)  # a forward pass that ran no gated module left it pending
        owed = bool(self.deferred.owed[i])
        if owed or self.strategy.landing([i]):
            # Owed: the forward used the old value. Landing: the previous average lands on top of this gradient.
            error = self.deferred.used_early(self.names[i], self.strategy.name, landing=not owed)
            self._fail(error)
            raise error
        if not self._open:
            self._open = True
            # Backward of the next step has begun: what is still owed belongs to parameters
            # this forward pass skipped, and must be applied before their memory is reused.
            self._apply(wait=False)
        self._used[i] = True
        self._passes[i] += 1
        if self._no_sync or self._passes[i] < self.bpps:
            return
        if self._sent[i]:
            raise stepping.ready_twice(self, i)
        if self.model_buffers.carrier is not None and not self.model_buffers.handed:
            with self._failing():  # the forward passes of the step are over: first on the link, ahead of gradients
                self.model_buffers.hand_over()
        self._send(i)

    def _send(self, i: int) -> None:
        self.buffers.attach(i)
        self._sent[i] = True
        if self.staging is not None:
            self.staging.to_host(i)  # delivers once the host copy is complete
        else:
            self._deliver(i)

    def _deliver(self, i: int) -> None:
        with self._failing():  # raised inside backward: the other ranks must hear of it too
            self.strategy.grad_ready(i)

    def _wait(self, indices) -> None:
        """The averaged gradients of these parameters are in .grad once this returns (on the GPU: queued)."""
        self.strategy.wait(indices)
        if self.staging is not None:
            self.staging.to_device(indices)

    def _on_module_enter(self, params: list[int]) -> None:
        if self.failed is None:
            self._apply(params, wait=False)

    def _before_forward(self, module, inputs) -> None:
        if self.failed is None:
            stepping.settle(self, wait=False)
            self._buffers_done()

    def _buffers_done(self) -> None:
        """The module buffers' average written back; a deferred exchange held for it sends again."""
        self.model_buffers.finish()
        self.strategy.release()

    def _before_reading(self) -> None:
        """model.state_dict() is never stale: owed updates and buffer averages land first."""
        if self.failed is None and not self._closed:
            self._flush()

    # -- the optimizer interface -----------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally in the backward passes inside; the next one outside averages them."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's idiom after an explicit synchronize(); step() already knows, so this only reads the same."""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place (they are views of the strategy's buffers; set_to_none is not honoured)."""
        self._usable()
        self._zeroed_open |= self._open  # what a backward sent is dropped: a GAN's other loss (stepping.ready_twice)
        if self.check.ready():  # a deferred step's agreement, in already: the buffers' average can start now
            stepping.settle(self)
        with device_work("zero_grad", lambda model: model.memset_s(4 * self.buffers.numel)):  # a GPU's memset
            self.deferred.zero_grad(owed_known=not self.check.pending or self._owed_early)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure")
        self._usable()
        explicit = self._synchronized
        if not explicit:
            stepping.exchange(self, full=False)
        self._synchronized = False
        with self._failing():
            stepping.update(self, immediately=explicit)
        return None

    def synchronize(self) -> None:
        """Finish all communication: average this step's gradients into .grad, or apply updates still owed.

        Before step() (after backward) the averaged gradients can then be read
        or clipped, under every strategy:

            loss.backward(); opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()                       # updates with the clipped gradients

        After step(), it applies the updates p3 defers to the next forward pass
        (forward passes and model.state_dict() do that by themselves).
        """
        self._usable()
        if self._open and not self._synchronized:
            stepping.exchange(self, full=True)
            with self._failing():
                self._wait(range(len(self.params)))
            self._synchronized = True
        else:
            self._flush()

    def _flush(self) -> None:
        self._apply()
        self._buffers_done()

    # -- one step ------------------------------------------------------------
    def _apply(self, indices=None, wait: bool = True) -> None:
        """Deferred updates owed to these parameters (all when None): applied, or the optimizer fails.
        wait=False: an agreement the updates were owed without is not waited for (stepping.settle)."""
        stepping.settle(self, wait=wait)
        with self._failing():
            try:
                self.deferred.apply(indices)
            except StallError:
                if not self._owed_early:
                    raise
                # Slices stall where a rank has not stepped: the agreement's own wait names it (rank 0 knows who
                # has not arrived), so that is the error raised, not the slices' owners'.
                stepping.settle(self)
                raise

    # -- failure and the end -----------------------------------------------------
    def _usable(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"this DistributedOptimizer stopped after an error ({type(self.failed).__name__}: "
                               f"{self.failed}); create a new one to continue") from self.failed
        if self._closed:
            raise RuntimeError("this DistributedOptimizer is closed")

    @contextlib.contextmanager
    def _failing(self):
        """An exception inside fails this optimizer (the other ranks hear of it), then propagates."""
        try:
            yield
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        teardown.fail(self, exc)  # tell the other ranks, cancel what is in flight, wait for nobody

    def abort(self, exc: BaseException) -> None:
        """This rank stops with `exc`: tell the other ranks (they raise PeerFailedError) and release everything."""
        teardown.abort(self, exc)

    def close(self) -> None:
        """Agree with every rank that training is over, apply what is owed, stop threads, free communicators."""
        teardown.close(self)

    def _release(self) -> None:
        teardown.release(self)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            self.abort(exc)
        else:
            self.close()

    def sum_over_ranks(self, values):
        """Collective, agreed like a step: `values` (numbers, array, tensor) summed element-wise over ranks."""
        return metrics.sum_over_ranks(self, values)

    # -- checkpoints ---------------------------------------------------------
    def state_dict(self) -> dict:
        """Collective. The optimizer state (unsharded) and the strategy's, rank-local parts on rank 0 only."""
        self.agree_on("state_dict()")
        return checkpoint.optimizer_state(self)

    def load_state_dict(self, state: dict | None) -> None:
        """Collective. `state` as state_dict() returned it; only rank 0's is read (others may pass None)."""
        self.agree_on("load_state_dict()")
        checkpoint.load_optimizer_state(self, state)

    def agree_on(self, call: str) -> None:
        """Collective: an agreement round, as a step's, before a collective call (a checkpoint's): a rank elsewhere
        (still stepping, or in another call) makes every rank raise CollectiveMismatchError naming it, where
        `if rank == 0: save_checkpoint(...)` left rank 0 waiting in the gather for ever. Owed updates land first."""
        self._usable()
        self._flush()
        with self._failing():
            self.check.run(CHECKPOINT, self.steps, digest(call), describe=lambda: [f"call={call}"])


def route_zero_grad(optimizer: torch.optim.Optimizer, zero_grad) -> Callable[[], None]:
    """optimizer.zero_grad(set_to_none) calls zero_grad(set_to_none) instead; the function returned undoes that."""
    previous = optimizer.__dict__.get("zero_grad")  # the instance's own (emulated compute's wrapper), else none

    def routed(set_to_none: bool = True) -> None:
        zero_grad(set_to_none)

    optimizer.zero_grad = routed

    def undo() -> None:
        if optimizer.__dict__.get("zero_grad") is routed:  # not wrapped again since
            if previous is None:
                del optimizer.zero_grad
            else:
                optimizer.zero_grad = previous
    return undo
