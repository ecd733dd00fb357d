"""--compute real | emulated:DEVICE | emulated:PROFILE.json and --compute-scale: what every benchmark and job accepts."""

from __future__ import annotations

import argparse
import time

from jobs.common.inputs import InputError, positive_finite

__all__ = ["add_compute_arguments", "check_compute", "Compute", "REAL_CPU", "where_and_how", "where_and_how_line"]

# What a benchmark without --compute names: its model (or its buffers) computed on this host's CPU.
REAL_CPU = "real compute, CPU"


def where_and_how(compute: str = REAL_CPU) -> dict:
    """{machine, compute} for a benchmark's JSON meta: every table, figure and JSON names both."""
    from jobs.common.report import machine

    return dict(machine=machine(), compute=compute)


def where_and_how_line(meta: dict) -> str:
    """`machine: ..., N cores (...), M GiB; real compute, CPU`: a table's header, a figure's title line."""
    from jobs.common.report import machine_line

    return f"{machine_line(meta['machine'])}; {meta['compute']}"


def add_compute_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compute", default="real",
                   help="real (default: the model computes), or emulated:DEVICE (a named GPU's modelled time per "
                        "layer: h100, v100, titanx, p4000, 1080ti, ...; DEVICE:amp for mixed precision) or "
                        "emulated:PROFILE.json (times measured by mpitrain simulate --take-profile)")
    p.add_argument("--compute-scale", type=float, default=1.0,
                   help="emulated compute: every modelled time times this (10: a GPU ten times slower; with links "
                        "ten times slower, the compute-to-communication ratio of links ten times faster; "
                        "default %(default)s)")


def check_compute(args) -> None:
    """A bad --compute is one line and exit 2, on every rank, before MPI or a model."""
    spec = args.compute
    # Finite too: inf passed `> 0` and every worker then died on OverflowError (a deadline out of range).
    positive_finite(args, "compute_scale")
    if spec == "real":
        if args.compute_scale != 1.0:
            raise InputError("--compute-scale", "applies to emulated compute only (--compute emulated:...)")
        return
    if not spec.startswith("emulated:") or not spec.removeprefix("emulated:"):
        raise InputError("--compute", f"{spec!r}: write real, emulated:DEVICE or emulated:PROFILE.json")
    from runtime.emulate import EmulationError, compute_model

    try:
        compute_model(spec.removeprefix("emulated:"))
    except EmulationError as e:
        raise InputError("--compute", str(e)) from None
    if getattr(args, "device", "cpu") == "cuda":
        raise InputError("--compute", "emulated compute runs on the host: leave --device at cpu")


class Compute:
    """What a job does with a model, its optimizer and its loss under the chosen compute."""

    def __init__(self, spec: str = "real", scale: float = 1.0):
        self.spec, self.scale = spec, scale
        self.emulated = spec != "real"
        self._model = None
        if self.emulated:
            from runtime.emulate import compute_model

            self._model = compute_model(spec.removeprefix("emulated:"))

    @classmethod
    def from_args(cls, args) -> "Compute":
        return cls(args.compute, args.compute_scale)

    def model(self, model, inputs: tuple):
        """The model itself (real), or emulated in place, traced with these example inputs."""
        if not self.emulated:
            return model
        from runtime.emulate import emulate

        return emulate(model, self._model, inputs, scale=self.scale)

    def optimizer(self, optimizer):
        if not self.emulated:
            return optimizer
        from runtime.emulate import emulate_optimizer

        return emulate_optimizer(optimizer)

    def now(self) -> float:
        """The clock a timed window reads at step boundaries: time.perf_counter(), or under emulation the
        device's timeline (runtime.emulate.device_time: the end of its queued work if that is later)."""
        if not self.emulated:
            return time.perf_counter()
        from runtime.emulate import device_time

        return device_time()

    def synchronize(self, device=None) -> None:
        """Wait for the device's queued work before a clock is read: a GPU's (torch.cuda.synchronize), or the
        emulated one's, which queues a backward and an update as a GPU does; nothing for real CPU compute."""
        if device is not None and device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        if self.emulated:
            from runtime.emulate import synchronize

            synchronize()

    def loss(self, loss_fn):
        if not self.emulated:
            return loss_fn
        from runtime.emulate import emulated_loss

        return emulated_loss

    def describe(self) -> dict:
        """For every row, table title and plot: the compute mode, the device model, the scale, what was emulated."""
        if not self.emulated:
            return dict(compute="real", compute_device=None, compute_spec=None, compute_scale=1.0, emulated_parts=[],
                        real_parts=[])
        from runtime.emulate import active

        acc = active()
        d = acc.describe() if acc is not None else {}
        return dict(compute=f"emulated ({self._model.label})", compute_device=self._model.device_name,
                    compute_spec=self.spec.removeprefix("emulated:"), compute_scale=self.scale,
                    emulated_parts=d.get("emulated", []), real_parts=d.get("real", []))

    @property
    def label(self) -> str:
        if not self.emulated:
            return "real compute"
        scale = f", compute x{self.scale:g}" if self.scale != 1 else ""
        return f"emulated compute: {self._model.label}{scale}"
