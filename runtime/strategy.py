"""The protocol between DistributedOptimizer and a synchronisation strategy, and what a strategy is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from mpicomm import Topology
from mpicomm.stall import DRIVE, StallPolicy, wait_until

from .emulate.accelerator import active as emulated_accelerator
from .grad_buffers import GradientBuffers


@dataclass
class StrategyContext:
    """Everything a strategy may use; it duplicates `topology`'s communicators for its own traffic."""

    topology: Topology
    params: list[torch.nn.Parameter]
    names: list[str]
    buffers: GradientBuffers
    options: object
    timeline: object = None
    policy: StallPolicy = field(default_factory=StallPolicy.from_env)
    shard_gradients: bool = False  # PTO: leave only this rank's averaged shard (grad_shard)
    momentum: float = 0.0  # SGD momentum moved into the strategy (sparse momentum correction)
    model: torch.nn.Module | None = None  # for strategies that pick layers (sufficient factors)
    interrupt: Callable[[], None] = lambda: None  # raises when another rank failed; every wait calls it
    # The module buffers' float64 host vector (runtime.model_buffers), offered to a strategy that `carries_buffers`:
    # its exchange averages it with the gradients each step. None: not offered (the buffers' own allreduce does).
    carried: torch.Tensor | None = None

    @property
    def compute_off_host(self) -> bool:
        """Whether this rank computes off the host's cores: on a GPU (its gradients staged through host memory)
        or an emulated one. A progress thread may then drive MPI while the training thread waits for it."""
        return self.buffers.staged or emulated_accelerator() is not None


class Strategy:
    """How gradients get averaged. DistributedOptimizer drives every strategy through these calls.

    Per step: `grad_ready(i)` as backward finalises parameter i's gradient
    (it sits in `ctx.buffers`), `finish(used, full)` once backward is over (`used`:
    which parameters any rank produced a gradient for; None for a deferred
    strategy, whose step's agreement is still in flight), then `wait(indices)`
    before those parameters are updated. Class attributes say how the wrapper
    treats the strategy:

    - deferred: updates are applied per layer, just before the layer's next
      forward (p3), rather than in step();
    - exact: synchronous SGD on the full gradient; parameters no rank used are
      then left alone, as one process would. A non-exact strategy's average can
      reach such parameters through delayed values: they are updated where it
      is non-zero;
    - hooks: accepts a DDP-style communication hook (bucketed strategies: they
      call `self.hook(self.hook_state, bucket)`, which register_comm_hook sets);
    - capture: modules whose layer inputs and output gradients the strategy
      needs (sufficient factors); the wrapper then calls `forwarded(k, input)`
      as capture[k] runs in a training forward pass, `captured(k, input,
      grad_output)` for it during backward, and `forward_started()` as each
      training forward pass of the model begins;
    - carries_buffers: takes `ctx.carried` (the module buffers' vector) into
      its own exchange: `carry_ready()` in step() hands it over with the
      gradients, `wait_carried()` returns once it holds the average.
    """

    name = "base"
    deferred = False
    exact = True
    hooks = False
    can_shard_gradients = False  # with PTO, may leave only this rank's averaged shard (grad_shard)
    progress_thread = False  # a thread of its own drives MPI: the wrapper's waits only watch
    carries_buffers = False
    trials = None  # p3's credit="online" trials (runtime.p3.online_credit.CreditTrials), where they run
    on_device = False  # works on the GPU gradients itself (buffers.device_flats); else the wrapper stages them
    problem_error = RuntimeError  # what every rank raises when a rank reports a local_problem()
    # Set by the wrapper where it stages the gradients through host memory (runtime.device): a strategy whose
    # exchange completes parameters one group at a time on its own thread (wfbp's buckets, p3's tensors) calls
    # it there with their indices, as soon as their averages are complete in the host buffers, so that their
    # copies back to the device start then, behind the rest of the exchange, not at the update.
    on_averaged = None

    @property
    def drives(self) -> bool:
        """Whether a progress thread of this strategy drives MPI while training waits (ProgressThread's drive)."""
        return bool(getattr(getattr(self, "progress", None), "drive", False))

    def __init__(self, ctx: StrategyContext):
        self.ctx = ctx
        self.params, self.buffers, self.timeline = ctx.params, ctx.buffers, ctx.timeline
        self.size = ctx.topology.size
        self.capture: list[torch.nn.Module] = []

    @classmethod
    def settle(cls, options, topology: Topology, params: list[torch.nn.Parameter]):
        """Collective, before layout(): the options with the "auto" settings that shape the buffers chosen."""
        return options

    @classmethod
    def layout(cls, params: list[torch.nn.Parameter], options, model: torch.nn.Module | None = None) \
            -> list[int] | None:
        """The order of the parameters inside the gradient buffers (None: the model's)."""
        return None

    @classmethod
    def adopt_momentum(cls, optimizer: torch.optim.Optimizer, options) -> float:
        """Before construction: take over the optimizer's momentum (DGC's correction); returns what was taken."""
        return 0.0

    def staging_groups(self) -> list[list[int]] | None:
        """Where the wrapper stages gradients through host memory: the groups of parameter indices to copy to
        the host together, each once all its gradients are final (every index once; None: groups of about a
        megabyte, last parameters first). Bucketed strategies give their buckets: nothing waits longer."""
        return None

    def set_priorities(self, priority: list[int]) -> None:
        """Per parameter, its layer's place in the first forward pass (smaller: needed sooner)."""

    def grad_ready(self, i: int) -> None:
        """Backward produced parameter i's final gradient; the strategy may start sending it."""

    def finish(self, used, full: bool = False) -> None:
        """Backward is over and every gradient has been handed to grad_ready.

        full: the caller wants every averaged gradient in .grad (synchronize()),
        even where the strategy would otherwise leave only a shard (PTO).
        """

    def wait(self, indices) -> None:
        """Block (under the stall policy) until these parameters' gradients are averaged."""

    def hold(self) -> None:
        """A deferred strategy's step() is over, its agreement in flight: send nothing new until release()."""

    def release(self) -> None:
        """The step's small collectives are done (or something waits for the exchange): send again."""

    def landing(self, indices) -> list[int]:
        """Of these parameters, those into whose .grad an earlier step's average may still land (a deferred
        strategy's exchange runs on past step()): a gradient accumulated there first would be overwritten."""
        return []

    def local_problem(self) -> str | None:
        """Before the step's agreement: a reason this rank cannot go on (a NaN gradient), or None."""
        return None

    def step_time(self, seconds: float) -> None:
        """A step's agreement is in (once a step, in order): the time from the step() before to this step's on
        the slowest rank (0: none), the same figure on every rank (p3's online credit tunes itself from it)."""

    @property
    def grad_shard(self):
        """With ctx.shard_gradients: this rank's block of the flat averaged gradient."""
        return None

    def forward_started(self) -> None:
        """A training forward pass of the model begins (with capture only)."""

    def forwarded(self, k: int, inputs: torch.Tensor) -> None:
        """capture[k] ran in a training forward pass on `inputs` (its output will need a gradient)."""

    def captured(self, k: int, inputs: torch.Tensor, grad_output: torch.Tensor) -> None:
        """Factors of capture[k] for this step: its input rows and its output-gradient rows."""

    def state_dict(self) -> dict:
        """{"shared": same on every rank, "local": this rank's own} (e.g. error-feedback residuals)."""
        return {"shared": {}, "local": {}}

    def load_state_dict(self, shared: dict, local: dict) -> None:
        if shared or local:
            raise ValueError(f"{self.name} keeps no state, but the checkpoint holds some")

    def abort(self) -> None:
        """Error path: cancel what is in flight without waiting for other ranks."""

    def close(self) -> None:
        """Stop threads and free communicators (after the last step completed)."""


def wait_handles(handles, what: str, ctx: StrategyContext, report=lambda: "") -> list:
    """Finish these collective handles under the stall policy, progressing all of them; returns their results."""
    wait_until(lambda: all([h.test() for h in handles]), what=what, report=report, policy=ctx.policy,
               who=f"rank {ctx.topology.rank}: ", interrupt=ctx.interrupt, spin=DRIVE)
    return [h.wait() for h in handles]


def capture_hooks(strategy: Strategy) -> list:
    """Forward hooks on the modules whose sufficient factors the strategy asked for.

    The output-gradient rows come from a hook on the layer's output tensor:
    they arrive as soon as backward reaches the layer, before its weight
    gradient is computed (and without the module-level backward hooks, which
    warn on a first layer whose input needs no gradient).
    """
    handles = []
    for k, module in enumerate(strategy.capture):
        def keep(mod, args, output, k=k):
            if output.requires_grad:
                rows = args[0].detach()
                strategy.forwarded(k, rows)
                output.register_hook(lambda grad, rows=rows: strategy.captured(k, rows, grad.detach()))

        handles.append(module.register_forward_hook(keep))
    model = strategy.ctx.model
    if strategy.capture and model is not None:
        def started(mod, args):
            if torch.is_grad_enabled():
                strategy.forward_started()

        handles.append(model.register_forward_pre_hook(started))
    return handles
