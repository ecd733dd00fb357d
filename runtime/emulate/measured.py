"""Single-GPU training throughputs measured on this project's own H100 box, beside the published ones."""

from __future__ import annotations

from .published import Throughput

__all__ = ["MEASURED", "SOURCE"]

# One run of the box's `calib.py` (benchmarks/device/2026-11-26/README.md says how): PyTorch 2.11.0+cu130
# eager, an "NVIDIA H100 80GB HBM3" (SXM5, driver 580.159.04) in a 16-core Xeon VM, our own models and synthetic
# batches, SGD with momentum, cudnn.benchmark on, NCHW; median of 15 steps after 5 warm-up steps, CUDA events.
# "tf32": cuDNN and cuBLAS on TF32 (allow_tf32); "fp32": both off; "amp": bf16 autocast (NGC's amp is fp16).
# Unlike the published points these are small, per-GPU batches (the papers' 32), where the host's launches
# count: they fit the launch cost, and the 3x3 convolutions (VGG), which no published H100 point constrains.
SOURCE = "benchmarks/device/2026-11-26/calib.jsonl"
_PT = "PyTorch 2.11.0+cu130 eager, measured on our H100 box"
_NOTE = "median of 15 steps (min {lo} ms, max {hi} ms per step); {what}"

MEASURED: tuple[Throughput, ...] = (
    Throughput("h100", "resnet50-224", 32, "tf32", 1369.24, "images/s", _PT, SOURCE,
               _NOTE.format(lo=22.79, hi=25.55, what="23.37 ms per step")),
    Throughput("h100", "resnet50-224", 256, "tf32", 1828.75, "images/s", _PT, SOURCE,
               _NOTE.format(lo=139.70, hi=140.38, what="139.99 ms per step; Lambda's NGC figure at 640: 1893")),
    Throughput("h100", "vgg19-224", 32, "tf32", 945.36, "images/s", _PT, SOURCE,
               _NOTE.format(lo=33.77, hi=34.11, what="33.85 ms per step")),
    Throughput("h100", "vgg19-22k-224", 32, "tf32", 894.49, "images/s", _PT, SOURCE,
               _NOTE.format(lo=35.70, hi=36.00, what="35.77 ms per step; Poseidon's VGG19-22K, 21,841 classes")),
    Throughput("h100", "resnet50-224", 32, "fp32", 752.49, "images/s", _PT, SOURCE,
               _NOTE.format(lo=41.90, hi=47.29, what="42.53 ms per step; TF32 off")),
    Throughput("h100", "vgg19-224", 32, "fp32", 455.04, "images/s", _PT, SOURCE,
               _NOTE.format(lo=70.20, hi=70.52, what="70.32 ms per step; TF32 off")),
    Throughput("h100", "resnet50-224", 256, "amp", 2191.43, "images/s", _PT, SOURCE,
               _NOTE.format(lo=116.41, hi=117.48, what="116.82 ms per step; bf16 autocast")),
)
# Measured too, outside the fit (no image input, so calibration's trace cannot take them; their emulation on
# the H100 is best driven by the profiles taken beside them, benchmarks/device/2026-11-26/profiles/):
# transformer-big batch 64 tf32 32.94 ms, fc-heavy batch 64 5.20 ms, char-lstm batch 64 9.76 ms per step.
