"""Nothing left posted at MPI_Finalize: jobs and failure paths under mpiexec, and the check shown to catch a leak."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from mpicomm.launch import mpiexec
from mpicomm.shutdown import check_env, leftovers

pytestmark = pytest.mark.timeout(150)

PROBE = [os.path.join(ROOT, "tests", "shutdown_probe.py")]
QUICK = ["-m", "jobs.train", "--model", "mlp", "--data", "synthetic", "--synthetic-samples", "512", "--batch-size",
         "32", "--no-progress", "--epochs", "1", "--max-steps", "4"]


def run(args: list[str], n: int = 2, status: int = 0) -> subprocess.CompletedProcess:
    """`args` under mpiexec with the leak check's environment (mpicomm.shutdown.check_env)."""
    env = check_env()
    # The probe runs as a file: its own directory comes first on sys.path, not this checkout.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    cmd = ["timeout", "120", mpiexec(), "-n", str(n), sys.executable, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=140)
    assert proc.returncode == status, proc.stderr[-3000:]
    return proc


def test_the_check_sees_requests_left_posted():
    """The check itself fails on leaks: a raw receive left posted shows as UCX's warning at MPI_Finalize; one
    in a RequestLog the exit step cancels first and names; a collective one rank never joined is named."""
    proc = run(PROBE + ["leaks"])
    found = leftovers(proc.stderr)
    assert sum("recv length 24 host memory} was not returned to mpool" in line for line in found) == 2, proc.stderr
    assert not any("recv length 40 " in line for line in found), proc.stderr  # cancelled before MPI_Finalize...
    assert sum("leak probe: 0 send(s), 1 receive(s) still posted (cancelled)" in line for line in found) == 2
    assert any("rank 0 alone entered: 1 abandoned collective(s) never completed" in line for line in found)


def test_requests_owners_release_leave_nothing():
    """Requests completed and released, a collective abandoned after every rank posted it, a thread stopped."""
    proc = run(PROBE + ["released"])
    assert leftovers(proc.stderr) == [] and proc.stdout.count("probe done") == 2, proc.stderr[-3000:]


def test_a_rank_failing_mid_step_leaves_nothing():
    """allreduce, wfbp and p3, rank 1 raising after backward and after step: the others stop in the step's
    agreement, in a ring collective or in a forward pass; nothing of the failed optimizers outlives them."""
    proc = run(PROBE + ["failure"], n=3)
    assert leftovers(proc.stderr) == [] and proc.stdout.count("probe done") == 3, proc.stderr[-3000:]


@pytest.mark.parametrize("args, status", [(["--strategy", "p3"], 0),
                                          (["--strategy", "topk", "--lr", "1e30", "--momentum", "0"], 3)],
                         ids=["p3", "non-finite gradient"])
def test_the_training_job_leaves_nothing(args, status):
    proc = run(QUICK + args, status=status)
    assert leftovers(proc.stderr) == [], proc.stderr[-3000:]
