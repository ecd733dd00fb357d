"""jobs.bench_mstopk times MSTopK and torch.topk and writes its table, JSON rows and plot (here: tiny)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_bench_mstopk_rows_table_and_plot(tmp_path):
    out, png = tmp_path / "mstopk.json", tmp_path / "mstopk.png"
    cmd = [sys.executable, "-m", "jobs.bench_mstopk", "--sizes", "100000", "--densities", "0.01", "--repeats", "2",
           "--json", str(out), "--png", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["mstopk-sampled", "mstopk-bisection", "torch.topk"]
    keys = {"d", "density", "k", "impl", "median_s", "min_s", "speedup_vs_topk", "count", "mass_ratio"}
    for r in rows:
        assert keys <= set(r) and r["d"] == 100_000 and r["density"] == 0.01 and r["k"] == 1000
        assert r["count"] == r["k"] and r["mass_ratio"] >= 0.99
        assert 0 < r["min_s"] <= r["median_s"] and r["speedup_vs_topk"] > 0
    assert rows[-1]["speedup_vs_topk"] == 1.0 and rows[-1]["mass_ratio"] == 1.0
    assert "| 100,000 | 0.01 | 1,000 | torch.topk |" in proc.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_mstopk_rejects_bad_density():
    proc = subprocess.run([sys.executable, "-m", "jobs.bench_mstopk", "--densities", "0.01,2"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "--densities: must be in (0, 1], got 2.0" in proc.stderr
