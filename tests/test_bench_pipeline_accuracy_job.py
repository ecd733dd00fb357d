"""jobs.bench.pipeline_accuracy under mpiexec -n 4: a tiny table (FC on 512 images), its JSON, markdown and plot."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from conftest import ROOT
from mpicomm.launch import mpiexec

METHODS = ["dp", "vanilla", "stash", "spectrain"]


def test_tiny_table_rows_markdown_and_plot(tmp_path):
    out, md = tmp_path / "acc.json", tmp_path / "acc.md"
    cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "jobs.bench.pipeline_accuracy", "--tasks", "fc", "--seeds", "1",
           "--epochs", "2", "--train-samples", "512", "--val-samples", "256", "--json", str(out), "--markdown", str(md)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["task"], r["method"]) for r in rows] == [("fc", m) for m in METHODS]
    assert doc["meta"]["ranks"] == 4 and doc["meta"]["tasks"]["fc"]["balance"] == [3, 2, 2, 1]
    assert doc["meta"]["compute"] == "real compute, CPU" and doc["meta"]["machine"]["cores"] >= 1
    for r in rows:
        assert r["seeds"] == 1 and len(r["runs"]) == 1
        assert 0 <= r["max_val_acc"] <= 1 and math.isfinite(r["min_train_loss"]) and math.isfinite(r["min_val_loss"])
        curve = r["runs"][0]["epochs"]
        assert [e["epoch"] for e in curve] == [1, 2]
        assert r["max_val_acc"] == max(e["val_acc"] for e in curve)
        assert r["min_val_loss"] == min(e["val_loss"] for e in curve)
        assert r["max_val_acc"] > 0.3, r  # 32 updates of 32 images: far above chance (0.1)
    assert rows[0]["delta_acc_vs_dp_points"] == 0
    table = md.read_text()
    for m in METHODS:
        assert f"| fc | {m} |" in table and f"| fc | {m} |" in proc.stdout
    assert "min train loss" in table and "Δ acc vs dp" in table
    assert "machine: " in table and "real compute, CPU" in table and "real compute, CPU" in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
