"""Named accelerators: sustained rates per op kind, memory bandwidth and launch cost, calibrated (calibration.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .flops import Work
from .trace import EmulationError

__all__ = ["Device", "DEVICES", "device", "PRECISIONS"]

PRECISIONS = ("fp32", "tf32", "amp")


@dataclass(frozen=True)
class Device:
    """A GPU as the roofline sees it: time = max(flops / (peak x efficiency), bytes / (bandwidth x efficiency))
    + kernels x launch, per kernel group. Peaks are the datasheet's (published.SPECS); the efficiencies are
    what calibration.py fitted to published training throughputs."""

    name: str
    full_name: str
    peak_tflops: dict  # precision -> dense peak TFLOP/s
    bandwidth_gbs: float
    pcie_gbs: float  # host <-> device copies, each direction
    launch_s: float  # per kernel: launch and tail, what a small kernel costs at least
    efficiency: dict = field(default_factory=dict)  # kind -> sustained fraction of the peak
    memory_efficiency: float = 0.7
    precision: str = "fp32"

    def at(self, precision: str) -> "Device":
        if precision not in self.peak_tflops:
            raise EmulationError(f"device {self.name} has no {precision} rate (it has "
                                 f"{', '.join(self.peak_tflops)})")
        return replace(self, precision=precision)

    def seconds(self, work: Work) -> float:
        """Modelled seconds of one unit of work on this device at its precision."""
        peak = self.peak_tflops[self.precision] * 1e12
        # Element-wise and normalisation work runs on the vector units at the FP32 rate, not the tensor
        # cores: AMP's gain there is halved bytes, not flops.
        if work.kind == "memory":
            peak = self.peak_tflops["fp32"] * 1e12
        compute = work.flops / (peak * self.efficiency_of(work.kind)) if work.flops else 0.0
        itemsize_ratio = 0.5 if self.precision == "amp" else 1.0
        memory = work.bytes * itemsize_ratio / (self.bandwidth_gbs * 1e9 * self.memory_efficiency_now)
        return max(compute, memory) + work.kernels * self.launch_s

    @property
    def memory_efficiency_now(self) -> float:
        """The memory efficiency at this precision: AMP's own where fitted (its kernels are fused, channels-last
        ones that move the data fewer times), else the device's."""
        return self.efficiency.get(f"memory:{self.precision}", self.memory_efficiency)

    def efficiency_of(self, kind: str) -> float:
        """The fitted fraction of the peak a kind sustains; each precision has its own (attention and recurrent
        layers are GEMMs)."""
        base = "gemm" if kind in ("attention", "recurrent") else kind
        key = base if self.precision == "fp32" else f"{base}:{self.precision}"
        return self.efficiency.get(key, self.efficiency.get(base, 0.5))

    @property
    def label(self) -> str:
        return f"{self.name} ({self.full_name}, {self.precision})"


# Fitted to published single-GPU training throughputs (calibration.py checks every one within 15 %):
# name -> (launch seconds per kernel, efficiency per matrix kind, memory efficiency, default precision,
# host <-> device GB/s: PCIe 5.0 x16 for the H100, 3.0 x16 for the others, as measured by bandwidthTest).
FITTED: dict[str, tuple] = {
    # fit("h100", 28): the published NGC points and those measured on our box (measured.py), which pin the
    # 3x3 convolutions (VGG), FP32 with TF32 off, and the small batches where launches count.
    "h100": (12e-6, {"conv": 0.33, "conv3x3": 0.878, "gemm": 0.75, "conv:tf32": 0.137, "conv3x3:tf32": 0.296,
                     "gemm:tf32": 0.6, "conv:amp": 0.064, "conv3x3:amp": 0.296, "gemm:amp": 0.6}, 0.871, "tf32", 50.0),
    # AMP with its own memory efficiency (fit("v100", 20, own_memory=("amp",), keep_first=True)): its
    # channels-last kernels fuse the normalisation and activations, so they move the data fewer times.
    "v100": (24e-6, {"conv": 0.819, "conv3x3": 1.355, "gemm": 0.75, "memory:amp": 0.95,
                     "conv:amp": 1.049, "conv3x3:amp": 0.394, "gemm:amp": 0.6}, 0.714, "fp32", 12.0),
    "titanx-maxwell": (6e-6, {"conv": 0.671, "conv3x3": 1.684, "gemm": 0.75}, 0.4, "fp32", 12.0),
    "p4000": (3e-6, {"conv": 0.671, "conv3x3": 1.355, "gemm": 0.75}, 0.4, "fp32", 12.0),
    "1080ti": (24e-6, {"conv": 0.819, "conv3x3": 1.355, "gemm": 0.75}, 0.557, "fp32", 12.0),
}
# Poseidon's "Titan X": the Maxwell card (see papers.PAPERS); P3's P4000 is fitted on its sibling GTX 1080.
ALIASES = {"titanx": "titanx-maxwell"}


def _build() -> dict[str, Device]:
    from .published import SPECS

    out = {}
    for name, (launch, eff, mem_eff, precision, pcie) in FITTED.items():
        s = SPECS[name]
        peaks = {"fp32": s.peak_fp32_tflops}
        if s.peak_tf32_tflops:
            peaks["tf32"] = s.peak_tf32_tflops
        if s.peak_fp16_tflops:
            peaks["amp"] = s.peak_fp16_tflops
        out[name] = Device(name, s.full_name, peaks, s.mem_bandwidth_gbs, pcie, launch, eff, mem_eff, precision)
    return out


DEVICES: dict[str, Device] = {}


def device(spec: str) -> Device:
    """'h100', 'v100:amp': a named device at a precision (its default without one)."""
    if not DEVICES:
        DEVICES.update(_build())
    name, _, precision = spec.lower().partition(":")
    name = ALIASES.get(name, name)
    if name not in DEVICES:
        raise EmulationError(f"unknown device {name!r}; named devices: {', '.join(sorted(DEVICES))} "
                             "(or give a profile: a .json file that mpitrain simulate --take-profile wrote)")
    d = DEVICES[name]
    return d.at(precision) if precision else d


def device_names() -> list[str]:
    if not DEVICES:
        DEVICES.update(_build())
    return sorted(DEVICES)
