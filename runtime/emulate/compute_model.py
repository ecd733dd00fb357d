"""Compute models: the seconds each traced unit takes forward and backward, and the accelerator's other work."""

from __future__ import annotations

import math
import os

from .devices import Device, device
from .flops import Work, work_of
from .trace import EmulationError, Trace

__all__ = ["ComputeModel", "RooflineModel", "ProfileModel", "compute_model", "name_modules"]


class ComputeModel:
    """What emulate() and the strategies ask: per-unit times, and the accelerator's own work by kind."""

    label = "compute model"
    device_name = "?"

    def unit_times(self, trace: Trace) -> list[tuple[float, float]]:
        raise NotImplementedError

    def optimizer_s(self, elements: int, tensors: int, state_per_element: int) -> float:
        """An optimizer step over `elements` in `tensors` tensors, each element reading and writing
        its parameter and `state_per_element` state values (SGD with momentum: 1; Adam: 2)."""
        raise NotImplementedError

    def gemm_s(self, m: int, n: int, k: int) -> float:
        raise NotImplementedError

    def select_s(self, elements: int) -> float:
        """Top-k selection and its bookkeeping over `elements` gradient elements (MSTopK on the device)."""
        raise NotImplementedError

    def copy_s(self, nbytes: int) -> float:
        """One host <-> device copy over PCIe."""
        raise NotImplementedError

    def memset_s(self, nbytes: int) -> float:
        """Zeroing `nbytes` of device memory."""
        return 0.0

    def pass_s(self, nbytes: int) -> float:
        """One element-wise pass over device memory that reads and writes `nbytes` in all (a scaling, a sum)."""
        return self.memset_s(nbytes)


class RooflineModel(ComputeModel):
    def __init__(self, dev: Device):
        self.device = dev
        self.device_name = dev.name
        self.label = f"{dev.label}, roofline"

    def unit_times(self, trace: Trace) -> list[tuple[float, float]]:
        itemsize = 4
        out = []
        for call in trace.calls:
            fwd, bwd = work_of(call, itemsize)
            out.append((self.device.seconds(fwd), self.device.seconds(bwd)))
        return out

    def optimizer_s(self, elements: int, tensors: int, state_per_element: int) -> float:
        # Read parameter, gradient and state, write parameter and state; multi-tensor kernels of ~24 tensors.
        nbytes = elements * 4 * (3 + 2 * state_per_element)
        return self.device.seconds(Work("memory", 4.0 * elements, nbytes, 2 * math.ceil(tensors / 24)))

    def gemm_s(self, m: int, n: int, k: int) -> float:
        return self.device.seconds(Work("gemm", 2.0 * m * n * k, 4.0 * (m * k + k * n + m * n), 1))

    def select_s(self, elements: int) -> float:
        # MSTopK: a few passes over |g| (threshold search), error feedback and velocity: ~8 passes.
        return self.device.seconds(Work("memory", 8.0 * elements, 8 * 4.0 * elements, 24))

    def copy_s(self, nbytes: int) -> float:
        return nbytes / (self.device.pcie_gbs * 1e9) + 10e-6

    def memset_s(self, nbytes: int) -> float:
        return self.device.seconds(Work("memory", 0.0, nbytes, 1))


class ProfileModel(ComputeModel):
    """Times measured by `mpitrain simulate --take-profile` (runtime.sim.measure), CPU or CUDA.

    A profile times the modules that own parameters, each forward from its start to the next one's (the
    parameter-free modules between are in it), each backward up to its last gradient: the owner carries
    the time, the units without parameters take none. A model run at another batch than the profile's (a
    pipeline's micro-batches) takes its times in proportion, as the simulator does: a GPU's small batches
    are less efficient than that, so take the profile at the batch you run where it matters.
    """

    def __init__(self, profile, path: str = ""):
        self.profile = profile
        self.device_name = f"profile:{profile.device}"
        where = f" {os.path.basename(path)}" if path else ""
        self.label = f"the profile{where} ({profile.model}, {profile.device}, batch {profile.batch_size})"
        self._elements = sum(l.elements for l in profile.layers)
        # The per-layer times come from hooked steps, which synchronise the device at every layer (a GPU's
        # queue drains 2 x 161 times a ResNet-50 step: +36 % on an H100); the plain steps time the whole
        # step without them. The layers keep their shares of the hooked step and take the plain step's total.
        layers = sum(l.fwd_s + l.bwd_s for l in profile.layers)
        rest = profile.step_s - profile.optimizer_s - profile.other_s
        self.scale = rest / layers if layers > 0 and rest > 0 else 1.0

    def unit_times(self, trace: Trace) -> list[tuple[float, float]]:
        layers = {l.name: l for l in self.profile.layers}
        # A part of a model (a pipeline's stage) carries its modules' names in the whole (name_modules): it
        # finds its own layers in the whole's profile, and the others are not missing.
        names = [getattr(c.module, _NAME, c.name) for c in trace.calls]
        part = any(hasattr(c.module, _NAME) for c in trace.calls)
        # The profile's owners are the modules with parameters of their own (runtime.sim.measure): a module
        # whose weight another owns too (tied embeddings) is one, though the trace gives that weight to the
        # unit called first.
        own = {n: tuple(p.numel() for p in c.module.parameters(recurse=False) if p.requires_grad)
               for n, c in zip(names, trace.calls)}
        owners = [n for n, params in own.items() if params]
        missing = [n for n in owners if n not in layers]
        unknown = [] if part else [n for n in layers if n not in own]
        if missing or unknown:
            raise EmulationError(
                f"the profile of {self.profile.model!r} was not taken from this model: "
                + (f"no times for {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing else "")
                + ("; " if missing and unknown else "")
                + (f"layers {', '.join(unknown[:4])} are not in it" if unknown else ""))
        for n in owners:
            if own[n] != layers[n].params:
                raise EmulationError(f"the profile of {self.profile.model!r} was not taken from this model: "
                                     f"{n} has parameters of {list(own[n])} elements, "
                                     f"the profile's {list(layers[n].params)}")
        first = trace.calls[0].inputs or (trace.calls[0].output,)
        batch = first[0].shape[0] if first[0].shape else self.profile.batch_size
        k = self.scale * batch / self.profile.batch_size
        seen: set[str] = set()
        out = []
        for n in names:
            if n in layers and n not in seen:
                seen.add(n)
                out.append((layers[n].fwd_s * k, layers[n].bwd_s * k))
            else:
                out.append((0.0, 0.0))
        # The rest of the measured step (input, loss, zero_grad) goes with the first unit's forward.
        if not part or self.profile.layers[0].name in seen:  # a stage without the input end has none of it
            out[0] = (out[0][0] + self.profile.other_s * batch / self.profile.batch_size, out[0][1])
        return out

    def optimizer_s(self, elements: int, tensors: int, state_per_element: int) -> float:
        return self.profile.optimizer_s * elements / max(1, self._elements)

    def gemm_s(self, m: int, n: int, k: int) -> float:
        return 2.0 * m * n * k / (self.profile.gflops * 1e9)

    def select_s(self, elements: int) -> float:
        return self.profile.select_s_per_element * elements

    def copy_s(self, nbytes: int) -> float:
        if self.profile.device == "cpu":
            return 0.0
        # A profile from before it measured its copies: PCIe 3.0 x16's ~12 GB/s.
        return nbytes / ((self.profile.copy_gbs or 12.0) * 1e9) + 10e-6


_NAME = "_emulated_profile_name"


def name_modules(model) -> None:
    """Name every module of `model` as its profile does (named_modules), so that a part of it, emulated alone
    (a pipeline's stage, one layer), finds its times in a profile of the whole."""
    for n, m in model.named_modules():
        setattr(m, _NAME, n or type(m).__name__)


def compute_model(spec: str) -> ComputeModel:
    """'h100', 'v100:amp' (a named device, roofline) or 'PATH.json' (a measured profile)."""
    if spec.endswith(".json") or os.sep in spec:
        from runtime.sim.profile import Profile, ProfileError

        try:
            return ProfileModel(Profile.load(spec), spec)
        except ProfileError as e:
            raise EmulationError(str(e)) from None
    return RooflineModel(device(spec))
