"""jobs.soak end to end: a few hundred p3 steps on 4 ranks without thread, request or memory growth."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from mpicomm.launch import mpiexec


def test_soak_reports_no_leak(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "jobs.soak", "--steps", "300", "--every", "50",
           "--settle", "50", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "-> ok" in proc.stdout and "0 left after close()" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == list(range(50, 301, 50))
    assert len({r["threads"] for r in rows}) == 1 and len({r["requests"] for r in rows}) == 1
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(120)
def test_soak_says_each_sample_as_it_is_taken_and_writes_nothing_unasked(tmp_path):
    """Its default is 2000 steps: rank 0 prints each sample when taken, not everything at the end."""
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "jobs.soak", "--steps", "20", "--every", "10", "--settle", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=100,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    progress = [line for line in proc.stdout.splitlines() if line.startswith("# step ")]
    assert [line.split(":")[0] for line in progress] == ["# step 5/20", "# step 10/20", "# step 20/20"]
    assert proc.stdout.index("# step 20/20") < proc.stdout.index("| step |") and "-> ok" in proc.stdout
    assert os.listdir(tmp_path) == []  # no --json, no --plot
