"""A job's process ends as a normal exit would, less the interpreter's teardown (~0.7 CPU-s with torch loaded)."""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
from typing import Callable, NoReturn

__all__ = ["ENV", "exit_with", "leave", "wanted"]

ENV = "MPITRAIN_QUICK_EXIT"  # "0": exit through the interpreter's teardown (a tool that hooks it, say)


def wanted(frame) -> bool:
    """Whether the job's module code running in `frame` is this process's main program: `python -m jobs.train`,
    `python job.py`, or the `mpitrain` command (jobs.cli.main, called by its script's top level), with runpy's
    frames between; not a module another program runs (runpy from its own code, an import), which gets its
    SystemExit. And the quick exit is not turned off (ENV)."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "no", "false"):
        return False
    outer = _outside_runpy(frame.f_back)
    if outer is not None and outer.f_globals.get("__name__") == "jobs.cli" and outer.f_code.co_name == "main":
        script = _outside_runpy(outer.f_back)  # the command's script, or jobs/__main__.py under `python -m jobs`
        outer = None if script is not None and _outside_runpy(script.f_back) is None else script
    return outer is None


def _outside_runpy(frame):
    while frame is not None and frame.f_globals.get("__name__") == "runpy":
        frame = frame.f_back
    return frame


def _code(status) -> int:
    """SystemExit's meaning of `status`: None is 0, an int itself, anything else printed and 1."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    print(status, file=sys.stderr)
    return 1


def _open_hdf5_files() -> int:
    if "h5py" not in sys.modules:
        return 0
    import h5py
    return h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)


def leave(status=None) -> NoReturn:
    """Exit with `status` as Python's exit does (non-daemon threads joined, atexit handlers run: fail-stop's
    agreement at exit, mpicomm.shutdown's safety net, logging's flush; then MPI_Finalize, which mpi4py leaves to
    the interpreter's teardown), then end the process through the C library's exit(), without that teardown:
    tearing down torch's thousands of modules and objects took ~0.7 CPU-s a process here, ~1 s of every 4-rank
    job on 2 cores. With an HDF5 file still open the normal exit runs instead: h5py closes it in the teardown,
    and a shard is not worth a bet on the HDF5 library's own exit handler."""
    code = _code(status)
    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not me and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # and forgotten: the fallback below does not run them twice
    if _open_hdf5_files():
        sys.exit(code)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe nobody reads any more: as the normal exit ignores them
            pass
    # The C library's exit(), not os._exit(): it runs the C-level exit handlers, which MPICH's clean end under
    # hydra needs (with os._exit after MPI_Finalize, 13 of 30 4-rank jobs ended "BAD TERMINATION", a rank killed;
    # with exit(), 0 of 30), and flushes C stdio. Through PyDLL, which keeps the GIL: no other Python thread runs
    # while those handlers tear the libraries down.
    ctypes.PyDLL(None).exit(code)


def exit_with(main: Callable[[], int | None], frame=None) -> NoReturn:
    """`sys.exit(main())` for a job's `if __name__ == "__main__":` block, leaving quickly where `wanted` (of
    `frame`, the module code's: the caller's by default)."""
    quick = wanted(frame or sys._getframe(1))
    try:
        status = main()
    except SystemExit as exc:
        if quick:
            leave(exc.code)
        raise
    if quick:
        leave(status)
    sys.exit(status)
