"""jobs.bench.overhead end to end: every configuration timed against plain torch, the agreement round, JSON and PNG."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT
from mpicomm.launch import mpiexec


def test_rows_for_every_configuration_and_the_agreement_round(tmp_path):
    out = tmp_path / "overhead.json"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "jobs.bench.overhead", "--models", "mlp", "--strategies",
           "allreduce,p3", "--steps", "2", "--warmup", "1", "--rounds", "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    timed = [r for r in rows if "step_s" in r]
    assert [r["strategy"] for r in timed] == ["plain", "allreduce", "p3"]
    assert all(r["step_s"] > 0 and r["ranks"] == 2 and r["rounds"] == 2 for r in timed)
    assert all(r["wrap_s"] > 0 for r in timed[1:])
    agreement = [r for r in rows if r["strategy"] == "step agreement"]
    assert len(agreement) == 1 and agreement[0]["agreement_s"] > 0 and agreement[0]["native_allreduce_s"] > 0
    assert "step agreement:" in proc.stdout and "| mlp | p3 | 2 |" in proc.stdout
    # Progress: each round's step times as it ends, before the table.
    rounds = [line for line in proc.stdout.splitlines() if line.startswith("# mlp, round ")]
    assert [line.split(":")[0] for line in rounds] == ["# mlp, round 1/2", "# mlp, round 2/2"]
    assert all(" ms" in line and "p3 " in line for line in rounds)
    assert proc.stdout.index("# mlp, round 2/2") < proc.stdout.index("| model |")
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_the_figure_says_how_many_ranks_it_timed():
    """Its title said "one rank" under mpiexec -n 4 as well."""
    from jobs.bench.overhead import figure

    rows = [dict(model="mlp", strategy=s, ranks=4, rounds=1, wrap_s=0.01, step_s=0.002, overhead_s=0.0)
            for s in ("plain", "p3")]
    title = figure(rows).axes[0].get_title()
    assert "4 ranks" in title and "one rank" not in title and "real compute" in title
