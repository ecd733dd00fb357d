"""jobs.bench.scaling runs each strategy on each rank count: the scaling table, JSON and plot (tiny, local)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.timeout(300)  # two MPI jobs, 1 and 2 ranks
def test_local_scaling_rows_efficiency_json_and_plot(tmp_path):
    out = tmp_path / "scaling.json"
    cmd = [sys.executable, "-m", "jobs.bench.scaling", "--local", "--models", "mlp", "--strategies", "allreduce,wfbp",
           "--ranks", "1,2", "--batch-size", "8", "--batches", "2", "--iters", "1", "--warmup", "1",
           "--rounds", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["meta"]["command"].startswith("python -m jobs.bench.scaling --local")
    rows = {(r["strategy"], r["ranks"]): r for r in doc["rows"]}
    assert sorted(rows) == [("allreduce", 1), ("allreduce", 2), ("wfbp", 1), ("wfbp", 2)]
    for (strategy, ranks), r in rows.items():
        one = rows[(strategy, 1)]
        assert r["baseline_ranks"] == 1 and r["samples_per_s"] > 0 and r["rounds"] == 1  # --rounds reaches the worker
        assert abs(r["speedup"] - r["samples_per_s"] / one["samples_per_s"]) < 1e-9
        assert abs(r["efficiency"] - r["samples_per_s"] / (ranks * one["samples_per_s"])) < 1e-9
        assert f"| mlp | local-unshaped | {strategy} | {ranks} | {r['samples_per_s']:.1f} |" in proc.stdout
    assert "| speed-up | efficiency |" in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
