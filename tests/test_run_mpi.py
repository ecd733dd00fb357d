"""make test's MPI runs (tests/run_mpi.py): a hung or crashed run ends with where each rank was, at the log's tail."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT
from mpicomm.launch import mpiexec

HANG = """
import time
from mpi4py import MPI

def test_one_rank_waits_for_another_that_never_comes():
    if MPI.COMM_WORLD.Get_rank() == 0:
        MPI.COMM_WORLD.Barrier()  # rank 0 waits here
    else:
        time.sleep(600)  # rank 1 is busy elsewhere
"""

CRASH = """
import os
from mpi4py import MPI

def test_one_rank_crashes():
    if MPI.COMM_WORLD.Get_rank() == 1:
        os.abort()  # as a fault in C code would end it: SIGABRT
    MPI.COMM_WORLD.Barrier()
"""

ONE_FAILS = """
from mpi4py import MPI

def test_fails_on_rank_1_alone():
    assert MPI.COMM_WORLD.Get_rank() != 1, "rank 1's own check"
"""


def _run(tmp_path, test_file: str, *pytest_args: str) -> str:
    """The output of tests/run_mpi.py running test_file on 2 ranks, with the plugin that names each rank's test."""
    cmd = [sys.executable, os.path.join(ROOT, "tests", "run_mpi.py"), "timeout", "120", mpiexec(), "-prepend-rank",
           "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-p", "running_test", *pytest_args, test_file]
    paths = [os.path.join(ROOT, "tests")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=150, env=env)
    assert out.returncode not in (0, 124), out.stdout[-3000:]
    return out.stdout[out.stdout.index("=== the MPI run failed"):]


def test_a_hung_run_ends_with_each_ranks_stack(tmp_path):
    (tmp_path / "test_hang.py").write_text(HANG)
    tail = _run(tmp_path, "test_hang.py", "-o", "faulthandler_timeout=2", "-o", "timeout=6",
                "-o", "timeout_method=thread")
    assert "rank 0: in test_hang.py::test_one_rank_waits_for_another_that_never_comes, for " in tail, tail
    rank0, rank1 = tail.split("--- rank 1")
    # faulthandler's dump of each ("line 7 in f"), and pytest-timeout's of the rank it ended ("line 7, in f").
    assert "--- rank 0" in rank0 and "line 7 in test_one_rank_waits" in rank0, tail
    assert "line 9 in test_one_rank_waits" in rank1, tail
    assert "line 7, in test_one_rank_waits" in rank0 or "line 9, in test_one_rank_waits" in rank1, tail
    assert "_pytest" not in tail, tail  # pytest's own frames left out


def test_a_crashed_rank_ends_with_its_stack_and_its_test(tmp_path):
    (tmp_path / "test_crash.py").write_text(CRASH)
    tail = _run(tmp_path, "test_crash.py")
    assert "rank 1: in test_crash.py::test_one_rank_crashes, for " in tail, tail
    rank1 = tail.split("--- rank 1")[1]
    assert "Fatal Python error: Aborted" in rank1 and "line 7 in test_one_rank_crashes" in rank1, tail


def test_a_test_failed_on_one_rank_ends_with_each_ranks_verdict(tmp_path):
    (tmp_path / "test_one.py").write_text(ONE_FAILS)
    tail = _run(tmp_path, "test_one.py")
    assert "rank 0: between tests" in tail and "rank 1: between tests" in tail, tail
    assert "rank 1: FAILED test_one.py::test_fails_on_rank_1_alone - AssertionError" in tail, tail
    assert "rank 1: 1 failed in " in tail and "rank 0: 1 passed in " in tail, tail


def test_a_run_that_passes_says_nothing_more(tmp_path):
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    pass\n")
    cmd = [sys.executable, os.path.join(ROOT, "tests", "run_mpi.py"), mpiexec(), "-prepend-rank", "-n", "2",
           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_ok.py"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "1 passed" in out.stdout and "=== the MPI run" not in out.stdout, out.stdout


def test_verdicts_include_a_quiet_ranks_report_and_what_it_left_behind():
    # As the suite's conftest.py writes them: ranks other than 0 report only on failure, after "[rank N] ".
    from run_mpi import outcomes

    lines = ["[0] 616 passed, 50 skipped in 125.89s (0:02:05)\n",
             "[1] [mpitrain] left at exit of the tests (rank 1): progress thread p3 still running (stopped)\n",
             "[2] [rank 2] FAILED tests/test_x_mpi.py::test_y - AssertionError: z\n",
             "[2] [rank 2] 1 failed, 615 passed in 126.00s\n", "[3] ....\n"]
    assert outcomes(lines) == {
        0: ["616 passed, 50 skipped in 125.89s (0:02:05)"],
        1: ["[mpitrain] left at exit of the tests (rank 1): progress thread p3 still running (stopped)"],
        2: ["FAILED tests/test_x_mpi.py::test_y - AssertionError: z", "1 failed, 615 passed in 126.00s"]}
