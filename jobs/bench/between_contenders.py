"""What a benchmark worker does between contenders, untimed: memory given back, MPI warmed before the first."""

from __future__ import annotations

import gc

__all__ = ["release_memory", "warm_mpi", "WARM_ELEMENTS"]

WARM_ELEMENTS = 32 << 20  # float32: 128 MB (a ResNet-50's gradients fit; VGG-19's 575 MB need not)


def release_memory() -> None:
    """Give the last contender's model, gradients and optimizer state back to the system before the next.

    glibc keeps freed blocks for reuse, so without a trim the ranks of a 128 M-parameter model held
    two models' worth each (2.9 GB) and eight of them on one machine were killed for memory.
    """
    import ctypes

    gc.collect()
    # What survived is live (torch's modules, MPI, the rounds so far): later collections need not walk it
    # again. Without this a full collection took 0.25-0.6 s per contender and round on a 2-core VM.
    gc.freeze()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def warm_mpi(comm, model: str) -> None:
    """A few untimed allreduces of the model's gradients' size (at most WARM_ELEMENTS) before the first round:
    MPI's own, and the ring's that the dense strategies run (mpicomm.Ring: point-to-point to its neighbours).

    Without them the allreduce strategy's first round ran some 25 % slower than its other four on
    unshaped local links (4 ranks, ResNet-50, emulated V100: 0.23-0.24 s a step against 0.19 s, whether
    it ran first or second in that round; its own warm-up steps did not absorb it), and that one round
    was the spread of the whole run. MPI's allreduce alone fixed it in three runs of four; with the
    ring's too, its first round was like the others in three runs of three (benchmarks/emulation.md).
    """
    import numpy as np
    import torch
    from mpi4py import MPI

    from mpicomm import Ring
    from runtime.workloads.models import build_model

    with torch.device("meta"):  # its size only: no memory, no initialisation (VGG-19-224: 575 MB a rank)
        n = sum(p.numel() for p in build_model(model).parameters())
    buf = np.ones(min(n, WARM_ELEMENTS), dtype=np.float32)
    for _ in range(3):
        comm.Allreduce(MPI.IN_PLACE, buf)
    with Ring(comm, validate=False) as ring:
        for _ in range(2):
            ring.allreduce(buf).wait()
    del buf
    release_memory()
