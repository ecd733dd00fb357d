"""Which weights a stage's forward and backward use: live (vanilla), stashed (PipeDream), predicted (SpecTrain)."""

# What each mode does, for a step of M micro-batches at the optimizer's
# learning rate lr (the rate chosen for the whole batch, as with one process):
#
# - flush: per micro-batch, forward and backward with the live weights, the
#   gradient of loss/M accumulated; per step, the pipeline drained and one
#   update at lr with the batch's mean gradient (equal to one process);
# - vanilla, stash, spectrain: per micro-batch, one update as soon as its
#   backward is done, at lr/M (the micro-batch's share of the batch); per step,
#   M such updates and no drain. lr/M is the linear scaling rule (Goyal et al.
#   2017): M updates of lr/M move the weights as far per step as one of lr, and
#   momentum is left per update (its horizon 1/(1 - momentum) updates is then
#   M times shorter in steps, the same in samples, as for SGD on micro-batches).
#   At lr itself each step made M full-rate updates with up to N - k - 1 of
#   staleness, and momentum SGD that flush trains at did not converge.
#
# The rate the engine applies is group["lr"] / M, set only for the optimizer's
# step (group["lr"] stays what the caller set: schedules keep working).
#
# A stage's optimizer updates its parameters in place after every backward,
# while up to N - k micro-batches are between their forward and backward. A
# backward computes with the tensors its forward saved; autograd saves
# parameters by reference, so left alone it would see the updated values (and
# refuse them: the in-place update bumps their version counter). A
# saved-tensors hook decides instead, per mode, what a saved parameter (or a
# view of one, such as the transposed weight a Linear layer saves) is at
# backward time:
#
# - vanilla: the live parameter, whatever updates happened since the forward;
# - stash: a copy taken at the forward (PipeDream's weight stashing: one copy
#   of each saved parameter per micro-batch in flight, in a reused pool);
# - spectrain: no copy is kept. The forward computes with weights predicted
#   s_f updates ahead, Ŵ = W - s·η·v (v: SGD's momentum buffer, η = lr/M the
#   rate each update really applies, so that s updates of the momentum
#   optimizer would move W by about s·η·v), and the backward with weights
#   predicted s_b updates ahead of the live ones;
# - spectrain-once: the forward's prediction (s = N - k - 1) is kept, as a
#   stash, and reused by the backward.
#
# Gradients always land on the parameters themselves (autograd's leaves), so
# the optimizer and the data-parallel strategies see nothing unusual. Every
# copy (stash pool, spectrain's buffers) is of a whole storage holding
# parameters (runtime.pipeline.storages: one per parameter, or one for all the
# weights of an LSTM that cuDNN flattened into one buffer), on the stage's
# device: a GPU stage keeps its weight versions on the GPU. A prediction is
# written and undone parameter by parameter, so it never touches elements of
# a storage that are no parameter's.

from __future__ import annotations

import contextlib

import torch

from .storages import ParamStorages

MODES = ("flush", "vanilla", "stash", "spectrain")
SPECTRAIN_VARIANTS = ("paper", "once")


def version_difference(stage: int, stages: int, variant: str = "paper") -> tuple[int, int]:
    """(s_forward, s_backward): how many updates ahead stage k of N predicts its weights.

    SpecTrain (Chen et al. 2018, section 4 and its public code): a
    micro-batch's forward at stage k runs ⌊k/2⌋ + N - k - 1 updates before the
    weights its gradient will be applied to, its backward ⌊k/2⌋. "once": one
    prediction, s = N - k - 1 (the updates the stage itself makes while the
    micro-batch is in flight), shared by forward and backward.
    """
    if variant not in SPECTRAIN_VARIANTS:
        raise ValueError(f"spectrain variant must be one of {SPECTRAIN_VARIANTS}, got {variant!r}")
    if variant == "once":
        return stages - stage - 1, stages - stage - 1
    return stage // 2 + stages - stage - 1, stage // 2


def momentum_sgd_hyper(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, with the reason, an optimizer SpecTrain cannot predict with."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(f"spectrain predicts weights from SGD's momentum buffer; {type(optimizer).__name__} "
                         "has none: use torch.optim.SGD(..., momentum=0.9) or another mode")
    for group in optimizer.param_groups:
        if not group.get("momentum", 0) > 0:
            raise ValueError("spectrain predicts weights from SGD's momentum buffer: give the optimizer "
                             f"momentum > 0 (a param group has momentum={group.get('momentum')!r})")


class WeightVersions:
    """The weights one stage computes with, per mode; forward(slot) and backward(slot) wrap the stage's passes.

    slot: the micro-batch's place in the stage's in-flight window (id mod in_flight).
    divisor: what the group's lr is divided by for each update (M in the asynchronous modes, see
    applied_lr); spectrain predicts with that rate.
    log: a list to append what each pass used (tests), or None.
    acc: the process's emulated accelerator (runtime.emulate) when the stage is emulated: nothing is saved
    for the backward and the optimizer keeps no momentum, so no copy is made or predicted; each pass waits
    instead what the copies and predictions above would take on the device (passes over every parameter).
    """

    def __init__(self, params: list[torch.Tensor], mode: str, in_flight: int, optimizer: torch.optim.Optimizer,
                 shifts: tuple[int, int] = (0, 0), once: bool = False, log: list | None = None, divisor: int = 1,
                 acc=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.params, self.mode, self.optimizer, self.log = params, mode, optimizer, log
        self.shifts, self.once, self.divisor = shifts, once, divisor
        self.in_flight = in_flight
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"a stage's parameters are on {sorted(map(str, devices))}: put the stage on one device")
        self.device = devices.pop() if devices else torch.device("cpu")  # where every weight copy is made
        # Saved tensors are found by their storage (they are often views: weight.t()); every weight copy
        # is of a whole storage, which may hold several parameters (an LSTM flattened by cuDNN). Flush and
        # emulated stages keep no versions.
        self.storages = ParamStorages(params if mode != "flush" and acc is None else [])
        self._lr = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._lr[id(p)] = group
        # The last stage (one micro-batch in flight) updates only after the backward: nothing to keep.
        keeps = in_flight > 1 and (mode == "stash" or (mode == "spectrain" and once))
        blocks = self.storages.blocks
        # Pool of copies: [slot][storage] (allocated on first use: only storages autograd saves from).
        self._stash: list[list[torch.Tensor | None]] = [[None] * len(blocks) for _ in range(in_flight)] \
            if keeps else []
        # spectrain: one buffer per storage, holding the live weights during a predicted forward
        # and the backward's prediction during a backward (never both at once).
        self._spare: list[torch.Tensor | None] = [None] * len(blocks)
        self._backward_views: list[torch.Tensor] | None = None
        self.updates = 0  # optimizer steps so far (versions), counted by the engine
        self.acc = acc
        if acc is not None:  # one read or write pass over the weights: a third of the optimizer's three
            self._pass_s = acc.model.optimizer_s(sum(p.numel() for p in params), len(params), 0) / 3

    # -- what the engine calls ---------------------------------------------------------
    @contextlib.contextmanager
    def applied_lr(self):
        """Around the optimizer's step: each group's lr divided by `divisor`, then put back as the caller set it."""
        groups = self.optimizer.param_groups
        configured = [g["lr"] for g in groups]
        if self.divisor != 1:
            for g in groups:
                g["lr"] = g["lr"] / self.divisor
        try:
            yield
        finally:
            for g, lr in zip(groups, configured):
                g["lr"] = lr

    def _rate(self, p) -> float:
        """The learning rate an update applies to p (the same division as applied_lr's)."""
        return self._lr[id(p)]["lr"] / self.divisor

    def forward(self, slot: int, micro: int):
        if self.mode == "flush":
            return contextlib.nullcontext()
        if self.acc is not None:
            return self._emulated(True)
        return self._forward(slot, micro)

    def backward(self, slot: int, micro: int):
        if self.mode == "flush":
            return contextlib.nullcontext()
        if self.acc is not None:
            return self._emulated(False)
        return self._backward(slot, micro)

    def _emulated(self, forward: bool):
        """The device time of this pass's weight versions: spectrain predicts once it has momentum (forward: copy
        the live W aside, W - s·η·v in place, put W back: 7 passes; backward: into the spare, 3), a stash copies
        the weights (2: read, write; spectrain-once stashes its forward's prediction)."""
        keeps = bool(self._stash)
        predicts = self.mode == "spectrain" and self.updates > 0 and self.shifts[0 if forward else 1] > 0
        passes = (7 if forward else 3) * (predicts and (forward or not keeps)) + 2 * (forward and keeps)
        if passes:
            self.acc.run("weight versions", passes * self._pass_s)
        return contextlib.nullcontext()

    def held_bytes(self) -> int:
        """Bytes of weight copies this mode holds now (stash pool, spectrain's buffers); emulated: would hold."""
        if self.acc is not None:
            size = sum(p.numel() * p.element_size() for p in self.params)
            spare = self.mode == "spectrain" and self.updates > 0 and \
                (self.shifts[0] > 0 or (self.shifts[1] > 0 and not self._stash))
            return size * (len(self._stash) + spare)
        tensors = [t for row in self._stash for t in row if t is not None] + [t for t in self._spare if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- forward ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _forward(self, slot: int, micro: int):
        predicted = self.mode == "spectrain" and self.shifts[0] > 0 and self._predict_into_params(self.shifts[0])
        copied: set[int] = set()
        keep = self._stash[slot] if self._stash else None
        storages = self.storages

        def pack(t: torch.Tensor):
            b = storages.find(t)
            if b is None:
                return t
            if keep is not None and b not in copied:  # one copy of the whole storage: every view of it reads true
                if keep[b] is None:
                    keep[b] = torch.empty_like(storages.blocks[b].flat)
                keep[b].copy_(storages.blocks[b].flat)
                copied.add(b)
            return (b, t.size(), t.stride(), t.storage_offset())

        if self.log is not None:
            self._record("F", micro, [p.detach().clone() for p in self.params],
                         self._param_views(self._spare) if predicted else self.params)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
        finally:
            if predicted:
                for p, live in predicted:
                    p.data.copy_(live)  # .data: the live weights come back without a version bump; only p's elements

    def _predict_into_params(self, s: int) -> list | None:
        """Params become W - s·η·v for the forward; the live W waits in the spare buffers. Returns the (param, its
        live weights) to put back, None before the first update (v unset: the prediction is W itself)."""
        velocities = self._velocities()
        if velocities is None:
            return None
        for block, spare in zip(self.storages.blocks, self._spares()):
            spare.copy_(block.flat)  # one copy per storage (a flattened LSTM's weights at once)
        changed = []
        for p, v, live in zip(self.params, velocities, self._param_views(self._spare)):
            if v is not None:
                p.data.add_(v, alpha=-s * self._rate(p))
                changed.append((p, live))
        return changed

    def _velocities(self) -> list | None:
        """SGD's momentum buffer of each parameter (None where it has none yet); None before the first update."""
        state = self.optimizer.state
        velocities = [state.get(p, {}).get("momentum_buffer") for p in self.params]
        return None if all(v is None for v in velocities) else velocities

    def _spares(self) -> list[torch.Tensor]:
        """One buffer per storage, allocated on first use and kept (spectrain's only weight copy)."""
        for b, block in enumerate(self.storages.blocks):
            if self._spare[b] is None:
                self._spare[b] = torch.empty_like(block.flat)
        return self._spare

    def _param_views(self, copies: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Each parameter's elements in per-storage copies (None for an empty parameter)."""
        of = self.storages.of
        return [None if of[i] is None else self.storages.view(copies[of[i]], p) for i, p in enumerate(self.params)]

    # -- backward ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _backward(self, slot: int, micro: int):
        if self._stash:
            self._backward_views = self._stash[slot]
        elif self.mode == "spectrain" and self.shifts[1] > 0:
            self._backward_views = self._prediction(self.shifts[1])
        else:
            self._backward_views = None  # the live parameters
        used: dict[int, torch.Tensor] = {}
        self._used = used if self.log is not None else None
        try:
            yield
        finally:
            if self.log is not None:
                self._record("B", micro, [used.get(i) for i in range(len(self.params))], self.params)
            self._backward_views, self._used = None, None

    def _prediction(self, s: int) -> list[torch.Tensor] | None:
        """W - s·η·v in the spare buffers, one per storage (None before the first update: the live W)."""
        velocities = self._velocities()
        if velocities is None:
            return None
        out = self._spares()
        for block, spare in zip(self.storages.blocks, out):
            # Elements the sums below do not write (no parameter's, or no velocity yet) are the live ones.
            if block.covered != block.flat.numel() or any(velocities[i] is None for i in block.members):
                spare.copy_(block.flat)
        for p, v, into in zip(self.params, velocities, self._param_views(out)):
            if v is not None:
                torch.add(p.detach(), v, alpha=-s * self._rate(p), out=into)
        return out

    def _unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        b, size, stride, offset = packed
        views = self._backward_views
        # A copy is of the whole storage: the saved view's offset reads the same elements in it.
        source = self.storages.blocks[b].flat if views is None or views[b] is None else views[b]
        if self._used is not None:
            for i in self.storages.touched(b, size, stride, offset, self.params):
                self._used[i] = self.storages.view(source, self.params[i]).clone()
        return source.as_strided(size, stride, offset)

    def _record(self, op: str, micro: int, used: list, live: list) -> None:
        state = self.optimizer.state
        self.log.append(dict(op=op, micro=micro, updates=self.updates, used=used,
                             live=[p.detach().clone() for p in live],
                             velocity=[state.get(p, {}).get("momentum_buffer", torch.zeros_like(p)).clone()
                                       for p in self.params],
                             lr=[self._rate(p) for p in self.params]))
