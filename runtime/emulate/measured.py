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

# model, batch, precision, images/s, then the step's median, min and max ms, and what else the run says
_RUNS = (
    ("resnet50-224", 32, "tf32", 1369.24, 23.37, 22.79, 25.55, ""),
    ("resnet50-224", 256, "tf32", 1828.75, 139.99, 139.70, 140.38, "; Lambda's NGC figure at 640: 1893"),
    ("vgg19-224", 32, "tf32", 945.36, 33.85, 33.77, 34.11, ""),
    ("vgg19-22k-224", 32, "tf32", 894.49, 35.77, 35.70, 36.00, "; Poseidon's VGG19-22K, 21,841 classes"),
    ("resnet50-224", 32, "fp32", 752.49, 42.53, 41.90, 47.29, "; TF32 off"),
    ("vgg19-224", 32, "fp32", 455.04, 70.32, 70.20, 70.52, "; TF32 off"),
    ("resnet50-224", 256, "amp", 2191.43, 116.82, 116.41, 117.48, "; bf16 autocast"),
)
MEASURED: tuple[Throughput, ...] = tuple(
    Throughput("h100", model, batch, precision, per_s, "images/s", _PT, SOURCE,
               f"median of 15 steps (min {lo:.2f} ms, max {hi:.2f} ms per step); {ms:.2f} ms per step{more}")
    for model, batch, precision, per_s, ms, lo, hi, more in _RUNS)
# Measured too, outside the fit (no image input, so calibration's trace cannot take them; their emulation on
# the H100 is best driven by the profiles taken beside them, benchmarks/device/2026-11-26/profiles/):
# transformer-big batch 64 tf32 32.94 ms, fc-heavy batch 64 5.20 ms, char-lstm batch 64 9.76 ms per step.
