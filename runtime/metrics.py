"""Metrics summed over ranks, agreed like a step: a rank at another point stops every rank, named, not a hang."""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from mpicomm.requests import abandon
from mpicomm.stall import wait_until
from mpicomm.step_check import METRIC, digest

from . import stepping


def sum_over_ranks(dopt, values):
    """The element-wise sum of `values` over the optimizer's ranks (numbers, a list, an array or a tensor).

    First an agreement round, as each step has: a rank that is elsewhere (it ran
    out of data a step early, closed, or sums something of another shape) makes
    every rank raise CollectiveMismatchError naming it and where it is. The
    result has the input's kind: a tensor for a tensor (on its device), else a
    numpy array.
    """
    dopt._usable()
    stepping.settle(dopt)  # a deferred step's agreement first: rounds complete in order
    tensor = values if torch.is_tensor(values) else None
    mine = np.asarray(tensor.detach().cpu().numpy() if tensor is not None else values, order="C")  # 0-d stays 0-d
    if mine.dtype.kind not in "biuf":
        raise TypeError(f"sum_over_ranks takes numbers, got an array of {mine.dtype}")
    if mine.dtype.kind == "b" or (mine.dtype.kind in "iu" and mine.dtype.itemsize < 8):
        # MPI has no SUM for bools (a count of correct predictions, pred == y), and narrow integers wrap: 64 bits.
        mine = mine.astype(np.int64 if mine.dtype.kind != "u" else np.uint64)
    shape = f"{mine.dtype} {tuple(mine.shape)}"
    total = np.empty_like(mine)
    with dopt._failing():
        dopt.check.run(METRIC, dopt.steps, digest(shape), describe=lambda: [f"sum_over_ranks of {shape}"])
        request = dopt.comm.Iallreduce(mine, total, op=MPI.SUM)
        try:
            wait_until(request.Test, what="sum_over_ranks", policy=dopt.policy, who=f"rank {dopt.rank}: ",
                       interrupt=dopt.check.interrupt)
        except BaseException:
            abandon(request, "sum_over_ranks", keep=(mine, total))
            raise
    if tensor is not None:
        return torch.from_numpy(total).to(tensor.device)
    return total
