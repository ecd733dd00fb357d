"""jobs.bench runs every strategy side by side and writes its table, JSON and plot (here: tiny, unshaped)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_local_bench_rows_table_and_plot(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "jobs.bench", "--local", "--hosts", "2", "--models", "mlp", "--batch-size", "8",
           "--batches", "2", "--iters", "1", "--warmup", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["strategy"] for r in rows] == ["allreduce", "wfbp", "p3", "ddp"]
    keys = {"model", "strategy", "bandwidth", "ranks", "samples_per_s", "ci", "t_iter_s", "t_compute_s", "t_comm_s"}
    for r in rows:
        assert keys <= set(r) and r["ranks"] == 2 and r["bandwidth"] == "local-unshaped"
        assert r["nodes"] == 2  # --local honours --hosts: one emulated node per host
        assert r["samples_per_s"] > 0 and r["t_iter_s"] > 0 and r["t_comm_s"] > 0
        assert abs(r["overlap_efficiency"] - max(r["t_compute_s"], r["t_comm_s"]) / r["t_iter_s"]) < 1e-9
    assert "| mlp | p3 | local-unshaped |" in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_worker_rejects_unknown_strategy():
    proc = subprocess.run([sys.executable, "-m", "jobs.bench_worker", "--strategies", "p4"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "--strategies: unknown 'p4'" in proc.stderr
