"""conftest's guard: pytest under mpiexec runs only tests marked mpi; serial ones stop the run, naming both commands."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT, serial_under_mpi
from mpicomm.launch import mpiexec

TESTS = """
import os
import pytest

@pytest.mark.gpu
def test_serial_gpu():  # a serial gpu test, as the job-level ones (which start their own mpiexec)
    open(os.path.join(os.path.dirname(__file__), f"ran-{os.getpid()}"), "w").close()

@pytest.mark.gpu
@pytest.mark.mpi
def test_mpi_gpu():
    pass
"""


def _under_mpi(tmp_path, name: str, text: str, markexpr: str, launch=()) -> subprocess.CompletedProcess:
    """pytest on 2 ranks (`launch` before mpiexec), running the test file `text` with this project's conftest and
    markers."""
    (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    cmd = [*launch, mpiexec(), *(["-prepend-rank"] if launch else []), "-n", "2", sys.executable, "-m", "mpi4py",
           "-m", "pytest", "-m", markexpr, "-q", "-p", "no:cacheprovider", "-p", "conftest", "-c",
           os.path.join(ROOT, "setup.cfg"), "--rootdir", str(tmp_path), str(tmp_path / name)]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)


def test_the_old_gpu_command_runs_no_serial_test_on_every_rank_and_names_the_right_commands(tmp_path):
    # The command README and setup.cfg used to give.
    out = _under_mpi(tmp_path, "test_both.py", TESTS, "gpu")
    text = out.stdout + out.stderr
    assert not list(tmp_path.glob("ran-*")), f"the serial test ran on {len(list(tmp_path.glob('ran-*')))} ranks"
    assert out.returncode != 0, text
    assert 'python -m pytest -m "gpu and not mpi"' in text and \
        'mpiexec -n 4 python -m mpi4py -m pytest -m "gpu and mpi"' in text, text
    assert text.count("serial test(s)") == 1, text  # rank 0 says it; the others keep quiet


def test_the_message_keeps_the_selection_and_lets_mpi_only_or_one_rank_runs_through():
    assert serial_under_mpi("gpu", 4, []) is None  # -m "gpu and mpi": nothing serial left
    assert serial_under_mpi("gpu", 1, ["t.py::a"]) is None  # plain pytest (or mpiexec -n 1)
    why = serial_under_mpi("gpu or cluster", 4, [f"t.py::t{i}" for i in range(5)])
    assert '-m "(gpu or cluster) and not mpi"' in why and "t.py::t2 and 2 more" in why and "4 ranks" in why
    assert '-m "not mpi"' in serial_under_mpi("", 2, ["t.py::a"])


LEAKS = """
import pytest
from mpi4py import MPI
from mpicomm import requests

@pytest.mark.mpi
def test_clean():
    MPI.COMM_WORLD.Barrier()

@pytest.mark.mpi
def test_rank_1_abandons_a_barrier_the_others_never_join():
    if MPI.COMM_WORLD.Get_rank() == 1:
        requests.abandon(MPI.COMM_WORLD.Ibarrier(), "a test's barrier", keep=())

@pytest.mark.mpi
def test_clean_again():
    pass
"""


def test_a_collective_left_on_one_rank_fails_the_run_naming_the_test_it_came_from(tmp_path):
    out = _under_mpi(tmp_path, "test_leaks.py", LEAKS, "mpi",
                     launch=[sys.executable, os.path.join(ROOT, "tests", "run_mpi.py"), "timeout", "120"])
    assert out.returncode not in (0, 124), out.stdout[-3000:]
    tail = out.stdout[out.stdout.index("=== the MPI run failed"):]
    # run_mpi.py's tail keeps rank 1's report, which names the leftover and the test after which it was there.
    assert ("rank 1: [mpitrain] left at exit of the tests (rank 1): a test's barrier: 1 abandoned collective(s) never "
            "completed") in tail, tail
    assert "[there after a test: a test's barrier (abandoned) since test_leaks.py::test_rank_1_abandons" in tail, tail
    assert "rank 0: 3 passed in " in tail and "rank 0: [mpitrain]" not in tail, tail
