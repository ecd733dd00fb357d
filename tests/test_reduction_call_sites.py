"""Every non-blocking reduction the tree posts is at a call site audited for its arrays' lifetime.

mpi4py's requests for Iallreduce, Ireduce, Ireduce_scatter(_block), Iscan, Iexscan, Iallgatherv and the persistent
*_init reductions hold no reference to their arrays (measured below; a corrupted heap in CI until 2026-12-07):
the caller must keep them until the request completes, and hand them to requests.abandon(keep=...) if it gives up.
A new call site fails here until it is checked for both and added to AUDITED.
"""

from __future__ import annotations

import os
import re
import sys

import numpy as np
from mpi4py import MPI

from conftest import ROOT
from test_layout import modules

CALL = re.compile(r"\.(I(?:allreduce|reduce|reduce_scatter|reduce_scatter_block|scan|exscan|allgatherv)"
                  r"|(?:Allreduce|Reduce|Reduce_scatter|Reduce_scatter_block|Scan|Exscan|Allgatherv)_init)\(")
# path: call sites, each read for (1) arrays owned by an object that lives until the request completes and
# (2) their hand-over to requests.abandon on every path that leaves the request pending.
AUDITED = {
    "mpicomm/native.py": 5,         # the Ring's Buffers; Sequencer.wait/_orphan abandon with `keep`
    "mpicomm/step_check.py": 2,     # StepCheck's round arrays; _join and stop_listening abandon them
    "runtime/metrics.py": 1,        # locals held across the wait; abandoned with keep=(mine, total)
    "runtime/model_buffers.py": 2,  # the staging array and _promote's values; each abandoned with its own
}


def test_every_reduction_call_site_is_audited():
    found = {}
    for path in modules().values():
        with open(path) as f:
            n = len(CALL.findall(f.read()))
        if n:
            found[os.path.relpath(path, ROOT)] = n
    assert found == AUDITED, (
        f"non-blocking reductions by file {found}, audited {AUDITED}: mpi4py's request does not keep their arrays "
        "alive: check the new call site for the two points above AUDITED, then add it there")


def test_mpi4py_still_keeps_no_reference_to_a_reductions_arrays():
    """The reason for the audit, measured: if a later mpi4py holds them, this fails and the audit can go."""
    comm = MPI.COMM_SELF
    a, b = np.ones(4), np.zeros(4)
    before = sys.getrefcount(a), sys.getrefcount(b)
    request = comm.Iallreduce(a, b)
    assert (sys.getrefcount(a), sys.getrefcount(b)) == before
    request.Wait()
    gather = comm.Iallgather(a, b)  # the contrast: a gather's request does hold its arrays
    assert sys.getrefcount(a) == before[0] + 1
    gather.Wait()
