"""Shared test helpers: MPI-aware output and collective assertions."""

from __future__ import annotations

import io
import os
import stat
import sys
import tempfile

import pytest

import running_test
from running_test import launcher_rank, pytest_runtest_logstart  # noqa: F401 (a hook)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def another_congestion_control() -> str | None:
    """A TCP congestion control the emulated hosts may take (the kernel's allowed list) other than the machine's
    default, or None."""
    from mpicomm.emulation import netns

    machine = netns.congestion_control()
    return next((name for name in netns.kernel_congestion_controls("allowed") if name != machine), None)


def exit_in_process(main, argv, capsys) -> tuple[object, str, str]:
    """(exit status, stdout, stderr) of a job's main(argv) run in this process. For inputs a job refuses before its
    work starts: a subprocess would spend its seconds importing torch (each file keeps one such case as a user runs
    it, from the command line)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _world_size() -> int:
    """The MPI world's size: MPI's own where it has started (python -m mpi4py), else the launcher's word."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI.COMM_WORLD.Get_size()
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def serial_under_mpi(markexpr: str, ranks: int, serial: list[str]) -> str | None:
    """Why a run may not go on: serial tests (not marked mpi) selected in an MPI world of several ranks.

    Every rank would run each of them at once: a GPU test's model N times on one GPU, a job test's own
    mpiexec started inside an MPI rank (with the outer launcher's environment). The message names the
    two commands that run the selection as the suites are meant to run.
    """
    if ranks <= 1 or not serial:
        return None
    expr = f"({markexpr})" if " or " in markexpr else markexpr
    plain = f'-m "{expr} and not mpi"' if expr else '-m "not mpi"'
    under = f'-m "{expr} and mpi"' if expr else "-m mpi"
    shown = ", ".join(serial[:3]) + (f" and {len(serial) - 3} more" if len(serial) > 3 else "")
    return (f"{len(serial)} serial test(s) (not marked mpi) selected under an MPI world of {ranks} ranks: every "
            f"rank would run each one ({shown}). Run serial tests with plain pytest: python -m pytest {plain}; "
            f"MPI tests under mpiexec: mpiexec -n 4 python -m mpi4py -m pytest {under}")


MPI_FILES = "_mpi.py"  # every test marked mpi lives in a file named so (tests/test_layout.py checks it)


def pytest_ignore_collect(collection_path, config):
    """`-m mpi` alone (the MPI parts of make test): the other test files are not imported, which every rank would
    otherwise do only to deselect their tests (~2.4 CPU-s a rank); a file named on the command line is collected."""
    if config.getoption("markexpr") != "mpi" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_") or collection_path.name.endswith(MPI_FILES):
        return None
    named = {os.path.abspath(str(a).split("::")[0]) for a in config.args}
    return None if str(collection_path) in named else True


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    """Under mpiexec only tests marked mpi may run: stop before any test with the commands that run them."""
    why = serial_under_mpi(config.getoption("markexpr") or "", _world_size(),
                           [item.nodeid for item in items if item.get_closest_marker("mpi") is None])
    if why:
        pytest.exit(why, returncode=pytest.ExitCode.USAGE_ERROR)


_quiet_report = None


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Under mpiexec only rank 0 reports; another rank's report is shown only if it failed. Each rank has its
    own root for pytest's temporary directories: ranks sharing one removed each other's old ones at once
    (PytestWarning "(rm_rf) error removing ...: Directory not empty", 2 of 4 runs)."""
    global _quiet_report
    if _world_size() > 1 and config.option.basetemp is None and "PYTEST_DEBUG_TEMPROOT" not in os.environ:
        # The user's id in the name: a second user's run on the same machine cannot use a root of ours (0700).
        root = os.path.join(tempfile.gettempdir(), f"pytest-mpi-{os.getuid()}-rank{launcher_rank()}")
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.lstat(root)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():  # else pytest's shared default, as before
            os.environ["PYTEST_DEBUG_TEMPROOT"] = root  # pytest's documented variable, read at the first tmp_path
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if launcher_rank() == "0" or reporter is None:
        return
    from _pytest.config import create_terminal_writer

    _quiet_report = io.StringIO()
    reporter._tw = create_terminal_writer(config, _quiet_report)


# MPI runs: each leftover (below) still there after a test -> the first test after which it was there. The
# report at the session's end names them: a collective abandoned on one rank alone, say, is otherwise anonymous.
_FIRST_SEEN: dict[str, str] = {}


def _leftovers() -> set[str]:
    """What this rank's tests have left so far: running progress threads, posted requests and abandoned
    collectives, by owner (a module's fixture may hold some between its tests; the report says which stayed)."""
    from mpicomm import progress, requests

    return ({f"progress thread {t.name}" for t in progress.running()} | set(requests.left_posted())
            | {f"{owner} (abandoned)" for owner in requests.abandoned_by()})


def pytest_runtest_logfinish(nodeid, location):
    running_test.pytest_runtest_logfinish(nodeid, location)
    if "mpicomm.requests" in sys.modules and _world_size() > 1:
        now = _leftovers()
        for kind in set(_FIRST_SEEN) - now:
            del _FIRST_SEEN[kind]
        for kind in now:
            _FIRST_SEEN.setdefault(kind, nodeid)


def pytest_sessionfinish(session, exitstatus):
    """Under mpiexec: requests, threads or collectives that tests left behind fail the run, named on stderr.

    mpicomm.shutdown would release them at exit anyway (and say so); here it
    runs first, so that a leak fails the suite instead of scrolling by.
    """
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    from mpicomm.shutdown import PREFIX, release_all

    said = release_all()
    if said:
        since = "; ".join(f"{kind} since {nodeid}" for kind, nodeid in sorted(_FIRST_SEEN.items()))
        sys.stderr.write(f"{PREFIX} of the tests (rank {MPI.COMM_WORLD.Get_rank()}): " + "; ".join(said)
                         + (f" [there after a test: {since}]" if since else "") + "\n")
        sys.stderr.flush()
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):
    if _quiet_report is not None and "failed" in _quiet_report.getvalue():
        rank = launcher_rank()
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in _quiet_report.getvalue().splitlines()))
        sys.stderr.flush()


@pytest.fixture
def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def assert_everywhere(comm, ok: bool, message: str = "") -> None:
    """Fail on every rank if the check failed on any rank, naming those ranks.

    A rank that raised alone would skip the collectives the others go on to
    call; agreeing first keeps every rank on the same path.
    """
    import numpy as np

    flags = np.empty(comm.Get_size(), dtype=np.int8)
    comm.Allgather(np.array([1 if ok else 0], dtype=np.int8), flags)
    bad = np.flatnonzero(flags == 0).tolist()
    assert not bad, f"failed on rank(s) {bad}: {message if not ok else '(see those ranks)'}"


def queued(comms) -> list:
    """(source, tag, bytes) of every message waiting on these communicators for this rank: received and dropped."""
    import numpy as np
    from mpi4py import MPI

    status, found = MPI.Status(), []
    for comm in comms:
        while (msg := comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)) is not None:
            found.append((status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)))
            msg.Recv([np.empty(found[-1][2], dtype=np.uint8), MPI.BYTE])
    return found


@pytest.fixture
def device(world):
    """gpu tests: this rank's GPU as the jobs pick it (local rank % GPUs): 4 ranks on one GPU share it."""
    from jobs.common.devices import rank_device
    from mpicomm import Topology

    with Topology(world) as topo:
        return rank_device("cuda", topo)
