"""A pytest plugin: each rank writes the test it is in where tests/run_mpi.py reads it after a failed run."""

from __future__ import annotations

import os
import time

__all__ = ["launcher_rank", "pytest_runtest_logstart", "pytest_runtest_logfinish"]

TRACE_ENV = "MPITRAIN_TEST_TRACE"  # tests/run_mpi.py's folder; unset: nothing is written


def launcher_rank() -> str:
    """This process's rank as the launcher told it (hydra, Open MPI, SLURM), without initialising MPI."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return os.environ[var]
    return "0"


def _write(text: str) -> None:
    folder = os.environ.get(TRACE_ENV)
    if folder and os.path.isdir(folder):
        # A whole small file each time (~600 tests a run): the reader never sees two tests' names.
        with open(os.path.join(folder, f"rank-{launcher_rank()}"), "w") as f:
            f.write(f"{time.time():.3f} {text}\n")


def pytest_runtest_logstart(nodeid, location):
    _write(nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _write("-")
