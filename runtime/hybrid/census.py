"""Per step, every rank's rows and uses of each factor layer and the fingerprint of its plan, gathered without blocking."""

from __future__ import annotations

import numpy as np

from mpicomm.agree import group_by_value
from mpicomm.progress import Task
from mpicomm.requests import abandon
from mpicomm.validate import CollectiveMismatchError


class Census:
    """An Iallgather of one small int64 vector per rank: [fingerprint, forward passes, rows[L], uses[L]].

    Posted at the step's first gradient (forward is over: rows and uses are
    known) and completed on the progress thread, so backward never waits for
    it (a rank whose backward produced nothing posts it only in step()).
    Every rank receives the same table, so every rank computes the same plan
    from it, and all of them raise together when the fingerprints differ.
    """

    def __init__(self, comm, layers: int, describe):
        self.comm = comm.Dup()
        self.describe = describe  # this rank's plan inputs, for the mismatch error
        self.rank, self.size, self.layers = self.comm.Get_rank(), self.comm.Get_size(), layers
        self.mine = np.zeros(2 + 2 * layers, dtype=np.int64)
        self.table = np.zeros((self.size, 2 + 2 * layers), dtype=np.int64)
        self.request = None
        self.complete = False

    def post(self, fingerprint: int, passes: int, rows, uses) -> None:
        self.mine[0], self.mine[1] = fingerprint, passes
        self.mine[2:2 + self.layers] = rows
        self.mine[2 + self.layers:] = uses
        self.complete = False
        self.request = self.comm.Iallgather(self.mine, self.table)

    def test(self) -> bool:
        """Whether the table is complete (MPI progresses inside); raises on every rank if fingerprints differ."""
        if not self.complete:
            if not self.request.Test():
                return False
            self.complete = True
            prints = self.table[:, 0]
            if (prints != prints[0]).any():
                raise CollectiveMismatchError(
                    "hybcomm: ranks would plan from different inputs (fingerprints by rank: "
                    f"{group_by_value([f'{int(v):x}' for v in prints])}); rank {self.rank} has {self.describe()}")
        return True

    def rows(self, k: int) -> list[int]:
        return self.table[:, 2 + k].tolist()

    def uses(self, k: int) -> list[int]:
        return self.table[:, 2 + self.layers + k].tolist()

    def passes(self) -> list[int]:
        return self.table[:, 1].tolist()

    def cancel(self) -> None:
        """Error path: MPI cannot cancel a collective request; it is completed in the background (mpicomm.requests)."""
        abandon(self.request, "hybcomm census", keep=(self.mine, self.table))
        self.request, self.complete = None, False

    def free(self) -> None:
        self.comm.Free()


class CensusTask(Task):
    """The census on the progress thread: once complete, `on_done()` (plan, start the layers that wait)."""

    __slots__ = ("census", "on_done")

    def __init__(self, census: Census, on_done):
        self.census, self.on_done = census, on_done

    def poll(self) -> bool:
        if not self.census.test():
            return False
        self.on_done()
        return True

    def __repr__(self) -> str:
        return "CensusTask"
