"""The hierarchy's cross-node step timed with each algorithm forced: `mpitrain cluster run -n 8 -- python THIS`.

Rounds interleave the three algorithms; each figure is the median of 30 calls, the slowest rank's, and the
printed value the median over rounds (then each round's). Reaches into Collectives._across (the per-size pick
of the cross-node algorithm) on purpose: it measures what that pick costs.
"""

import numpy as np
from mpi4py import MPI

from mpicomm import Collectives, Topology

comm = MPI.COMM_WORLD
rounds, calls = 5, 30
with Topology(comm) as topo, Collectives(topo, algorithm="hierarchical") as coll:
    times = {}
    for nbytes in (4096, 65536, 262144):
        x = np.zeros(nbytes // 4, np.float32)
        for _ in range(rounds):
            for across in ("doubling", "rabenseifner", "ring"):
                coll._across[nbytes] = across
                ts = []
                for _ in range(calls):
                    comm.Barrier()
                    t0 = MPI.Wtime()
                    coll.allreduce(x).wait()
                    ts.append(MPI.Wtime() - t0)
                worst = np.array([np.median(ts)])
                comm.Allreduce(MPI.IN_PLACE, worst, op=MPI.MAX)
                times.setdefault((nbytes, across), []).append(float(worst[0]))
    if comm.Get_rank() == 0:
        print(f"# {topo.num_nodes} nodes x {topo.local_size}, hierarchical allreduce, cross-node algorithm forced")
        for (nbytes, across), t in times.items():
            print(f"{nbytes:>8} B  {across:<13} {1e3 * np.median(t):6.3f} ms   rounds: "
                  + " ".join(f"{1e3 * v:.2f}" for v in t))
