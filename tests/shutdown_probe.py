"""Leaves MPI requests posted at exit on purpose, or releases them all: tests/test_shutdown.py runs it (mpiexec)."""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from mpicomm.progress import HandleTask, ProgressThread
from mpicomm.requests import RequestLog, abandon
from mpicomm.ring import Ring


def leaks(comm: MPI.Comm) -> None:
    """A raw receive (24 bytes) and a logged one (40 bytes) nobody completes; a collective one rank never joins."""
    peer = (comm.Get_rank() + 1) % comm.Get_size()
    raw = np.zeros(3, dtype=np.float64)
    comm.Irecv(raw, peer, 7)  # dropped: only MPI_Finalize meets it
    RequestLog("leak probe").irecv(comm, np.zeros(5, dtype=np.float64), peer, 8)
    lonely = comm.Dup()
    if comm.Get_rank() == 0:
        abandon(lonely.Ibarrier(), "leak probe: a barrier rank 0 alone entered", keep=())


def released(comm: MPI.Comm) -> None:
    """What owners do right: complete and release, abandon a collective every rank posted, stop the thread."""
    ring = Ring(comm, latency_bytes=0)
    thread = ProgressThread("probe")
    x = np.ones(1000, dtype=np.float32)
    thread.submit(HandleTask(ring.allreduce(x))).wait(60)
    assert x[0] == comm.Get_size()
    abandon(comm.Ibarrier(), "probe barrier", keep=())  # every rank posts it: it completes, at the latest at exit
    thread.stop()
    ring.free()


def failure(comm: MPI.Comm) -> None:
    """Rank 1 raises mid-step, after backward then after step, under each strategy; every rank goes on."""
    import torch
    import torch.nn as nn

    from runtime import DistributedOptimizer

    for strategy in ("allreduce", "wfbp", "p3"):
        for when in ("after backward", "after step"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(11, 13), nn.Tanh(), nn.Linear(13, 5))
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            try:
                with DistributedOptimizer(opt, model, strategy, comm=comm) as dopt:
                    for step in range(4):
                        dopt.zero_grad()
                        model(torch.randn(6, 11)).sum().backward()
                        if step == 2 and comm.Get_rank() == 1 and when == "after backward":
                            raise OSError("disk went away")
                        dopt.step()
                        if step == 2 and comm.Get_rank() == 1:
                            raise OSError("disk went away")
            except Exception as exc:  # noqa: BLE001 - every rank stops: rank 1 with its error, the others hear it
                assert "disk went away" in str(exc), exc
            else:
                raise AssertionError(f"{strategy}, {when}: no rank stopped")


if __name__ == "__main__":
    {"leaks": leaks, "released": released, "failure": failure}[sys.argv[1]](MPI.COMM_WORLD)
    MPI.COMM_WORLD.Barrier()
    print("probe done", flush=True)
