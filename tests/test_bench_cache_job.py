"""jobs.bench.cache end to end on a small PNG set: its configurations, JSON rows and plot."""

from __future__ import annotations

import json
import subprocess
import sys

from datacache_helpers import make_png_dataset

from conftest import ROOT
from mpicomm.launch import mpiexec


def test_bench_cache_rows_and_plot(tmp_path):
    src = make_png_dataset(tmp_path / "png", n=200, size=28)
    out = tmp_path / "bc.json"
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "notes.txt").write_text("not a shard")  # the cold start removes shards only
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "jobs.bench.cache", "--source", src, "--cache-dir",
           str(tmp_path / "cache"), "--epochs", "2", "--batch-size", "32", "--workers", "0", "--rounds", "2",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    configs = [r["config"] for r in data["rows"]]
    assert configs == ["cache epoch 1 (cold)", "cache epoch 2 (warm)", "cache + 0 workers (warm)",
                       "cache + 0 workers, per sample (warm)", "raw DataLoader, 0 workers"]
    assert all(r["samples"] == 200 and r["samples_per_s"] > 0 for r in data["rows"])
    assert [len(r["rounds"]) for r in data["rows"][2:]] == [2, 2, 2] and data["meta"]["workers"] == 0
    assert data["meta"]["cache_disk_bytes"] > 200 * 28 * 28 * 4 and data["meta"]["cache_memory_bytes"] > 0
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "cache" / "notes.txt").read_text() == "not a shard"


def test_bench_cache_needs_a_warm_epoch():
    proc = subprocess.run([sys.executable, "-m", "jobs.bench.cache", "--epochs", "1"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "--epochs: must be >= 2" in proc.stderr
