"""jobs.bench.mstopk times MSTopK and torch.topk and writes its table, JSON rows and plot (here: tiny)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT


def test_bench_mstopk_rows_table_and_plot(tmp_path):
    out, png = tmp_path / "mstopk.json", tmp_path / "mstopk.png"
    cmd = [sys.executable, "-m", "jobs.bench.mstopk", "--sizes", "100000", "--densities", "0.01", "--repeats", "2",
           "--json", str(out), "--png", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["mstopk-sampled", "mstopk-bisection", "torch.topk"]
    keys = {"d", "density", "k", "impl", "median_s", "min_s", "max_s", "speedup_vs_topk", "count", "exactly_k",
            "mass_ratio"}
    for r in rows:
        assert keys <= set(r) and r["d"] == 100_000 and r["density"] == 0.01 and r["k"] == 1000
        assert r["count"] == r["k"] and r["exactly_k"] and r["mass_ratio"] >= 0.99
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"] and r["speedup_vs_topk"] > 0
    assert rows[-1]["speedup_vs_topk"] == 1.0 and rows[-1]["mass_ratio"] == 1.0
    assert "| 100,000 | 0.01 | 1,000 | torch.topk |" in proc.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_mstopk_rejects_bad_density():
    proc = subprocess.run([sys.executable, "-m", "jobs.bench.mstopk", "--densities", "0.01,2"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "--densities: must be in (0, 1], got 2.0" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error torch gives without a CUDA device")
def test_bench_mstopk_cuda_without_a_gpu_is_one_clear_line():
    proc = subprocess.run([sys.executable, "-m", "jobs.bench.mstopk", "--device", "cuda"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: --device: cuda, but torch {torch.__version__} sees no "
                                                "CUDA device"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
def test_bench_mstopk_on_cuda(tmp_path):
    out = tmp_path / "mstopk-cuda.json"
    cmd = [sys.executable, "-m", "jobs.bench.mstopk", "--device", "cuda", "--sizes", "1M", "--densities", "0.001,0.01",
           "--repeats", "3", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["meta"]["device"] == torch.cuda.get_device_name() and doc["meta"]["torch"] == torch.__version__
    assert [r["impl"] for r in doc["rows"]] == ["mstopk", "torch.topk"] * 2
    for r in doc["rows"]:
        assert r["exactly_k"] and r["mass_ratio"] >= 0.99 and 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
    assert (tmp_path / "mstopk-cuda.png").read_bytes()[:4] == b"\x89PNG"


def test_cpu_calls_are_interleaved_round_by_round():
    """Every implementation's repeat r before any one's repeat r+1 (the order rotating), not each one's repeats back
    to back: a slow moment of the machine then weighs on all alike."""
    from jobs.bench.mstopk import time_interleaved

    calls = []
    fns = {name: (lambda name=name: calls.append(name) or (name,)) for name in ("a", "b", "c")}
    timed = time_interleaved(fns, 3)
    assert calls == ["a", "b", "c"] + ["a", "b", "c"] + ["b", "c", "a"] + ["c", "a", "b"]  # warm-ups, 3 rounds
    assert {name: t[3] for name, t in timed.items()} == {"a": ("a",), "b": ("b",), "c": ("c",)}
    assert all(0 <= t[1] <= t[0] <= t[2] for t in timed.values())


def test_the_plot_option_is_plot_as_in_every_job_and_png_still_works(tmp_path):
    from jobs.bench.mstopk import parse_args

    assert parse_args(["--plot", str(tmp_path / "a.png")]).plot == str(tmp_path / "a.png")
    assert parse_args(["--png", str(tmp_path / "b.png")]).plot == str(tmp_path / "b.png")
    assert parse_args(["--json", str(tmp_path / "m.json")]).plot == str(tmp_path / "m.png")
