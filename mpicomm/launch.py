"""Command lines for mpiexec, including hydra's emulation of several hosts on this one; the jobs' entry point."""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from typing import Callable, NoReturn

from . import quick_exit

FAKE_SSH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher", "fake-ssh")


def mpiexec() -> str:
    """The mpiexec that belongs to this Python's MPI (the mpich wheel's, in a venv), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("no mpiexec found beside this Python or on PATH (pip install mpich)")
    return found


def emulated_hosts(layout: str) -> list[str]:
    """hydra options that start ranks on fake hosts, e.g. layout "n1:2,n2:2".

    Each host name gets its own hydra proxy, so MPI_Comm_split_type(SHARED)
    groups ranks by fake host although all of them run here.
    """
    return ["-hosts", layout, "-launcher", "ssh", "-launcher-exec", FAKE_SSH]


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Exit with main()'s status; an uncaught exception on any rank aborts every rank of the job.

    An exception ends only its own rank: the others would wait for it in their next collective
    forever. So the traceback is printed (each line prefixed with the rank) and, with fail-stop on
    (mpicomm.failstop, installed by importing runtime), every other rank is told and prints why
    before the job ends; otherwise MPI_COMM_WORLD is aborted, as `python -m mpi4py` does for
    scripts. SystemExit passes through: a job that
    exits with a status chose it on every rank. Without MPI started, or on one rank, the exception
    propagates as usual. Called by the process's main program, the exit skips the interpreter's teardown
    (mpicomm.quick_exit).
    """
    quick_exit.exit_with(lambda: _stopping_the_job(main), sys._getframe(1))


def _stopping_the_job(main: Callable[[], int | None]) -> int | None:
    """main()'s status; its exception stops every rank (run_main)."""
    try:
        return main()
    except SystemExit:
        raise
    except BaseException:  # KeyboardInterrupt too: one rank interrupted leaves the others waiting as well
        MPI = sys.modules.get("mpi4py.MPI")
        if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
            raise
        from . import failstop
        if failstop.fail(sys.exc_info()[1]):  # does not return
            raise
        rank, exc = MPI.COMM_WORLD.Get_rank(), sys.exc_info()[1]
        interrupt = isinstance(exc, KeyboardInterrupt)  # ^C, here or heard of: where, not a traceback a rank
        lines = [failstop.error_text(exc)] if interrupt else traceback.format_exc().rstrip("\n").split("\n")
        sys.stdout.flush()
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in lines))
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(failstop.INTERRUPTED if interrupt else 1)
