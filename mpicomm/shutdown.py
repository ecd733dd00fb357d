"""Before MPI_Finalize: stop leftover threads, cancel logged requests, complete abandoned collectives; say so."""

from __future__ import annotations

import atexit
import sys

from mpi4py import MPI

from . import progress, requests

# Seconds the exit waits for abandoned collectives: every rank posted them long ago, so they
# complete at once unless a rank never joined (it failed first); then waiting longer is useless.
GRACE = 2.0
PREFIX = "[mpitrain] left at exit"  # what the report on stderr starts with (tests look for it)

# A job run with this environment shows on its stderr every request it left posted at MPI_Finalize.
# UCX warns at finalize about each request still in its pool ("object 0x... {recv length 240 host
# memory} was not returned to mpool ucp_requests"), but MPICH moves messages between ranks of one
# host through its own shared memory, where only ANY_SOURCE receives are UCX requests: NOLOCAL
# sends everything through the UCX netmod, as between hosts. The netmod is named, so that a build
# falling back to OFI cannot pass silently; UCX logs at warning level, to stderr (not its default,
# stdout).
CHECK_ENV = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_LOG_LEVEL": "warn",
             "UCX_LOG_FILE": "stderr"}
# What MPI and this module print about leftovers at finalize (MPICH: requests on COMM_WORLD never freed).
SIGNS = ("was not returned to mpool", "unexpected tag-receive descriptor", "MPICH: Builtin communicator",
         "MPICH: freeing inactive persistent request", PREFIX)


def check_env(base: dict | None = None) -> dict:
    """os.environ (or `base`) with CHECK_ENV applied, for a job whose leftovers a test looks for."""
    import os

    return dict(os.environ if base is None else base, **CHECK_ENV)


def leftovers(stderr: str) -> list[str]:
    """The lines of a job's stderr that report something left at MPI_Finalize (run under check_env())."""
    return [line for line in stderr.splitlines() if any(sign in line for sign in SIGNS)]


def release_all(grace: float = GRACE) -> list[str]:
    """End what owners left behind; one line per kind of leftover, empty when nothing was left.

    Owners release their own requests and threads (close(), or their error
    path); this is the safety net run at interpreter exit. It reports rather
    than hides: a leftover here is a bug in its owner.
    """
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return []
    said = []
    for thread in progress.running():
        # First: a thread polling requests while they are cancelled, or during MPI_Finalize, crashes.
        ended = thread.abort()
        said.append(f"progress thread {thread.name} still running ({'stopped' if ended else 'blocked: left behind'})")
    for owner, (sends, recvs) in sorted(requests.left_posted().items()):
        said.append(f"{owner}: {sends} send(s), {recvs} receive(s) still posted (cancelled)")
    requests.join_late()  # before cancelling: a failed agreement still reads the notices that came late
    requests.cancel_all()
    never = requests.finish_abandoned(grace)
    requests.drain()  # not reported: after a failure, messages nobody will receive are expected
    for owner in sorted(set(never)):
        said.append(f"{owner}: {never.count(owner)} abandoned collective(s) never completed (a rank never "
                    "joined them)")
    return said


def _at_exit() -> None:
    # Python's atexit handlers run before mpi4py's, which calls MPI_Finalize (registered with Py_AtExit).
    said = release_all()
    if said:
        sys.stderr.write(f"{PREFIX} (rank {MPI.COMM_WORLD.Get_rank()}): " + "; ".join(said) + "\n")
        sys.stderr.flush()


atexit.register(_at_exit)
