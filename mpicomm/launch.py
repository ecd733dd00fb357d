"""Command lines for mpiexec, including hydra's emulation of several hosts on this one."""

from __future__ import annotations

import os
import shutil
import sys

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
