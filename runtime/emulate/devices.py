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
        # Element-wise and normalisation work runs on the vector units at the FP32/FP16 rate, not the
        # tensor cores: AMP's gain there is halved bytes, not flops.
        if work.kind == "memory":
            peak = self.peak_tflops["fp32"] * 1e12
        compute = work.flops / (peak * self.efficiency.get(work.kind, 0.5)) if work.flops else 0.0
        itemsize_ratio = 0.5 if self.precision == "amp" else 1.0
        memory = work.bytes * itemsize_ratio / (self.bandwidth_gbs * 1e9 * self.memory_efficiency)
        return max(compute, memory) + work.kernels * self.launch_s

    @property
    def label(self) -> str:
        return f"{self.name} ({self.full_name}, {self.precision})"


# Fitted to published single-GPU training throughputs (calibration.py checks every one within 15 %):
# name -> (launch seconds per kernel, efficiency per matrix kind, memory efficiency, default precision).
FITTED: dict[str, tuple] = {}


def _build() -> dict[str, Device]:
    from .published import SPECS

    out = {}
    for name, (launch, eff, mem_eff, precision) in FITTED.items():
        s = SPECS[name]
        peaks = {"fp32": s.peak_fp32_tflops}
        if s.peak_tf32_tflops:
            peaks["tf32"] = s.peak_tf32_tflops
        if s.peak_fp16_tflops:
            peaks["amp"] = s.peak_fp16_tflops
        out[name] = Device(name, s.full_name, peaks, s.mem_bandwidth_gbs, s.pcie_gbs, launch, eff, mem_eff, precision)
    return out


DEVICES: dict[str, Device] = {}


def device(spec: str) -> Device:
    """'h100', 'v100:amp': a named device at a precision (its default without one)."""
    if not DEVICES:
        DEVICES.update(_build())
    name, _, precision = spec.lower().partition(":")
    if name not in DEVICES:
        raise EmulationError(f"unknown device {name!r}; named devices: {', '.join(sorted(DEVICES))} "
                             "(or give a profile: a .json file that mpitrain simulate --take-profile wrote)")
    d = DEVICES[name]
    return d.at(precision) if precision else d
