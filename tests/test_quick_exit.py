"""mpicomm.quick_exit: a job's process ends as a normal exit would (status, atexit, threads, output, MPI, HDF5),
without the interpreter's teardown; only where the job is the process's main program."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT
from mpicomm.launch import mpiexec

# A job's main program: an atexit handler, a non-daemon thread still writing, output left in the buffers, and an
# object whose __del__ only the interpreter's teardown runs (the sign that the teardown ran).
PROGRAM = textwrap.dedent("""
    import atexit, sys, threading, time
    from mpicomm.quick_exit import exit_with

    class Torn:
        def __del__(self):
            print("torn down", flush=True)

    KEEP = Torn()
    atexit.register(lambda: print("atexit ran"))

    def late():
        time.sleep(0.3)
        print("thread done")

    def main():
        threading.Thread(target=late).start()
        sys.stdout.write("buffered, no newline")
        return {status}

    if __name__ == "__main__":
        exit_with(main)
""")


def run(tmp_path, status="3", env=None, launcher=()):
    script = tmp_path / "job.py"
    script.write_text(PROGRAM.format(status=status))
    env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([*launcher, sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)


def test_a_job_ends_with_its_status_threads_atexit_and_output_but_no_teardown(tmp_path):
    proc = run(tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.startswith("buffered, no newline") and "thread done" in proc.stdout, proc.stdout
    assert proc.stdout.index("thread done") < proc.stdout.index("atexit ran")  # threads joined first, as exit does
    assert "torn down" not in proc.stdout


def test_turned_off_the_exit_goes_through_the_teardown(tmp_path):
    proc = run(tmp_path, env={"MPITRAIN_QUICK_EXIT": "0"})
    assert proc.returncode == 3 and "atexit ran" in proc.stdout and "torn down" in proc.stdout, proc.stdout


@pytest.mark.parametrize("status, code, err", [("None", 0, ""), ("'no data'", 1, "no data")])
def test_the_status_means_what_sys_exit_makes_of_it(tmp_path, status, code, err):
    proc = run(tmp_path, status=status)
    assert proc.returncode == code and proc.stderr.strip() == err and "torn down" not in proc.stdout


def test_run_by_another_program_it_raises_systemexit_and_ends_nothing(tmp_path):
    (tmp_path / "job.py").write_text(PROGRAM.format(status="5"))
    code = ("import runpy, sys\n"
            "try:\n    runpy.run_path('job.py', run_name='__main__')\n"
            "except SystemExit as exc:\n    print('caller got', exc.code)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0 and "caller got 5" in proc.stdout, proc.stdout + proc.stderr


def test_an_hdf5_file_left_open_is_written_whole_by_the_normal_exit(tmp_path):
    h5py = pytest.importorskip("h5py")
    program = textwrap.dedent("""
        import h5py, numpy as np
        from mpicomm.quick_exit import exit_with

        def main():
            global F
            F = h5py.File("left-open.h5", "w")  # never closed: only the teardown closes it
            F.create_dataset("x", data=np.arange(100_000))
            return 0

        if __name__ == "__main__":
            exit_with(main)
    """)
    (tmp_path / "job.py").write_text(program)
    proc = subprocess.run([sys.executable, "job.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "left-open.h5", "r") as f:
        assert f["x"].shape == (100_000,) and int(f["x"][-1]) == 99_999


def test_an_mpi_jobs_ranks_end_cleanly_every_time(tmp_path):
    """MPI_Finalize, which mpi4py leaves to the teardown, runs, and the process ends through the C library's exit():
    ended by os._exit after MPI_Finalize, 13 of 30 4-rank jobs of this program ended with hydra's "BAD TERMINATION"
    (a rank killed, exit code 9). Ten jobs: a clean end every time."""
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        from mpi4py import MPI
        from mpicomm.quick_exit import exit_with

        def main():
            MPI.COMM_WORLD.Barrier()
            return 0

        if __name__ == "__main__":
            exit_with(main)
    """))
    for run in range(10):
        proc = subprocess.run([mpiexec(), "-n", "4", sys.executable, "job.py"], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
        assert proc.returncode == 0, f"job {run + 1}: status {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"


def test_ranks_of_a_job_agree_at_exit(tmp_path):
    """Two ranks of a run_main job (`mpitrain topology`): fail-stop's agreement at exit runs too."""
    out = tmp_path / "t.json"
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "jobs.topology", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and out.exists(), proc.stdout + proc.stderr
    assert "error" not in proc.stderr.lower(), proc.stderr
