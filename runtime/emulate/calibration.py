"""The named devices against published single-GPU training throughputs: predictions, errors, and the fit behind them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from .devices import Device, device
from .flops import work_of
from .measured import MEASURED
from .published import SIBLINGS, SPECS, THROUGHPUTS, Throughput
from .trace import trace

__all__ = ["MODELS", "Prediction", "predictions", "fit"]

# Published figures of models we build (the others, GoogLeNet, GNMT, BERT..., are kept in published.py).
MODELS = ("resnet50-224", "vgg19-224", "vgg16-224", "vgg19-22k-224")
VGG16_CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


@dataclass(frozen=True)
class Prediction:
    point: Throughput
    device: str  # the device model that predicted it (a sibling's figures calibrate a device without any)
    predicted: float  # samples/s

    @property
    def error(self) -> float:
        return self.predicted / self.point.samples_per_s - 1.0


def _build(name: str) -> nn.Module:
    from runtime.workloads.models import build_model

    with torch.device("meta"):
        if name != "vgg16-224":
            return build_model(name)
        model = build_model("vgg19-224")
        layers, prev = [], 3
        for c in VGG16_CONFIG:
            layers += [nn.MaxPool2d(2)] if c == "M" else [nn.Conv2d(prev, c, 3, padding=1), nn.ReLU()]
            prev = c if c != "M" else prev
        layers.append(nn.AdaptiveAvgPool2d((7, 7)))
        model.features = nn.Sequential(*layers)
        return model


_WORK: dict = {}


def _work(model: str, batch: int):
    """(per-unit (fwd, bwd) work, parameter elements, parameter tensors) of a model at a batch; traced once."""
    key = (model, batch)
    if key not in _WORK:
        m = _build(model)
        x = torch.empty((batch, 3, 224, 224), device="meta")
        tr = trace(m, (x,))
        params = [p for p in m.parameters()]
        _WORK[key] = ([work_of(c) for c in tr.calls], sum(p.numel() for p in params), len(params))
    return _WORK[key]


def step_seconds(dev: Device, model: str, batch: int, optimizer: bool = True) -> float:
    """A training step's modelled seconds: every unit forward and backward, and SGD with momentum."""
    from .compute_model import RooflineModel

    works, elements, tensors = _work(model, batch)
    t = sum(dev.seconds(f) + dev.seconds(b) for f, b in works)
    return t + (RooflineModel(dev).optimizer_s(elements, tensors, 1) if optimizer else 0.0)


def _points(name: str, fitted: bool = True) -> list[Throughput]:
    """A device's published points of models we build. fitted: those the fit uses. A V100 SXM3 (a DGX-2's,
    up to 450 W) is not the SXM2 part we model: its fp32 points are shown, not fitted, as the SXM2 has
    four; its amp points are fitted, as they are the only ones beside one SXM2 ResNet-50."""
    source = SIBLINGS.get(name, name)
    return [t for t in THROUGHPUTS + MEASURED if t.device == source and t.model in MODELS
            and not (fitted and t.precision == "fp32" and "SXM3" in t.note + t.framework + t.source)]


def _predict(dev: Device, t: Throughput) -> float:
    # The 2015-17 Torch7 figures time forward and backward only.
    with_optimizer = "no optimizer" not in t.note
    return t.batch / step_seconds(dev.at(t.precision), t.model, t.batch, with_optimizer)


def predictions(names=None) -> list[Prediction]:
    """Every published figure of a model we build, against the named device's prediction (a sibling's, for
    a device with none of its own: the sibling's spec with the device's efficiencies)."""
    out = []
    for name in names or _named():
        dev = device(name)
        sibling = SIBLINGS.get(name)
        if sibling:
            s = SPECS[sibling]
            dev = replace(dev, name=sibling, peak_tflops={"fp32": s.peak_fp32_tflops},
                          bandwidth_gbs=s.mem_bandwidth_gbs)
        out += [Prediction(t, dev.name if not sibling else f"{name} via {sibling}", _predict(dev, t))
                for t in _points(name, fitted=False)]
    return out


def _named() -> list[str]:
    from .devices import device_names

    return device_names()


GEMM_PRIOR = {"fp32": 0.75, "tf32": 0.6, "amp": 0.6}


def _arrays(dev: Device, t: Throughput):
    """Per work item of a point's step: kind, flops, bytes, kernels (numpy), for a vectorised fit."""
    from .flops import Work

    works, elements, tensors = _work(t.model, t.batch)
    items = [w for pair in works for w in pair]
    if "no optimizer" not in t.note:
        # RooflineModel.optimizer_s's work, rebuilt here: read/write parameter, gradient, momentum.
        items.append(Work("memory", 4.0 * elements, elements * 4 * 5, 2 * -(-tensors // 24)))
    kinds = np.array([{"conv": 0, "conv3x3": 1}.get(w.kind, 3 if w.kind == "memory" else 2) for w in items])
    return (kinds, np.array([w.flops for w in items]), np.array([w.bytes for w in items]),
            np.array([w.kernels for w in items], dtype=float))


def fit(name: str, steps: int = 12, own_memory: tuple = (), keep_first: bool = False) -> tuple:
    """(launch, efficiencies, memory efficiency, worst error) with the smallest worst error over the device's
    published points (its sibling's, for one with none), on a grid. Each precision's points fit its own conv,
    conv3x3 and gemm efficiencies; all share one memory efficiency and launch cost, chosen for the smallest
    worst error over every precision, except a precision in own_memory, which fits its own memory efficiency.
    keep_first: hold the first precision at the device's current values (refit the others only)."""
    dev = device(name)
    sibling = SIBLINGS.get(name)
    if sibling:
        s = SPECS[sibling]
        dev = replace(dev, peak_tflops={"fp32": s.peak_fp32_tflops}, bandwidth_gbs=s.mem_bandwidth_gbs)
    points = _points(name)
    wino = np.geomspace(0.1, 2.6, steps)
    mems = np.linspace(0.4, 0.95, 8)
    launches = np.array([3e-6, 6e-6, 12e-6, 24e-6, 36e-6, 48e-6])
    grids: dict[str, np.ndarray] = {}  # precision -> candidate rows (conv, conv3x3, gemm, mem, launch)
    worsts: dict[str, np.ndarray] = {}  # precision -> each row's worst error over that precision's points
    for precision in ("fp32", "tf32", "amp"):
        mine = [t for t in points if t.precision == precision]
        if not mine:
            continue
        # No published point is GEMM-bound enough to fit it: cuBLAS-class priors (large SGEMM sustains ~85-90 %
        # of the FP32 peak on a V100, tensor-core GEMMs ~70-80 % of theirs), lowered for the smaller GEMMs of models.
        gemm = [GEMM_PRIOR[precision]]
        # Direct convolutions reach at most the FP32 peak; tensor-core kernels are rated against a dense peak
        # that AMP's fused kernels (and the 1x1 convolutions' bigger GEMMs) can approach more closely.
        conv = np.geomspace(0.05, 1.0 if precision == "fp32" else 1.5, steps)
        g = np.array(list(itertools.product(conv, wino, gemm, mems, launches)))  # conv, conv3x3, gemm, mem, launch
        if keep_first and not grids:
            e = dev.efficiency
            g = np.array([[e["conv"], e["conv3x3"], e["gemm"], dev.memory_efficiency, dev.launch_s]])
        worst = np.zeros(len(g))
        for t in mine:
            d = dev.at(t.precision)
            kinds, flops, nbytes, kernels = _arrays(d, t)
            peak = np.where(kinds == 3, d.peak_tflops["fp32"], d.peak_tflops[t.precision]) * 1e12
            eff = np.ones((len(g), len(kinds)))
            for k in range(3):
                eff[:, kinds == k] = g[:, k:k + 1]
            ratio = 0.5 if t.precision == "amp" else 1.0
            compute = flops / (peak * eff)
            compute[:, kinds == 3] = flops[kinds == 3] / peak[kinds == 3]  # vector units at full rate
            memory = nbytes * ratio / (d.bandwidth_gbs * 1e9 * g[:, 3:4])
            step = (np.maximum(compute, memory) + kernels * g[:, 4:5]).sum(axis=1)
            worst = np.maximum(worst, np.abs(t.batch / step / t.samples_per_s - 1))
        grids[precision], worsts[precision] = g, worst
    # The precisions share the launch cost and (but those in own_memory) the memory efficiency: choose the pair
    # whose best rows have the smallest worst error over every precision, not the first precision's best alone.
    first = next(iter(grids))
    worst_all, picks = np.inf, {}
    for mem, launch in np.unique(grids[first][:, 3:5], axis=0):
        worst_pair, pick = 0.0, {}
        for precision, g in grids.items():
            ok = np.flatnonzero((g[:, 4] == launch) & ((g[:, 3] == mem) | (precision in own_memory)))
            if not len(ok):
                worst_pair = np.inf
                break
            pick[precision] = ok[np.argmin(worsts[precision][ok])]
            worst_pair = max(worst_pair, float(worsts[precision][pick[precision]]))
        if worst_pair < worst_all:
            worst_all, picks, mem_launch = worst_pair, pick, (mem, launch)
    mem, launch = mem_launch
    best: dict = {}
    for precision, k in picks.items():
        g = grids[precision]
        suffix = "" if precision == "fp32" else f":{precision}"
        if g[k, 3] != mem:
            best[f"memory{suffix}"] = g[k, 3]
        best.update({f"conv{suffix}": g[k, 0], f"conv3x3{suffix}": g[k, 1], f"gemm{suffix}": g[k, 2]})
    return launch, {k: round(float(v), 3) for k, v in best.items()}, round(float(mem), 3), worst_all
