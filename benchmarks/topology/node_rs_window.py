"""A node's reduce-scatter: mpicomm's Ring on the node communicator against an MPI-3 shared window.

    mpiexec -n 2 python benchmarks/topology/node_rs_window.py SIZES [ROUNDS]

SIZES: bytes, comma-separated (float32). Every node (MPI_COMM_TYPE_SHARED) reduce-scatters alone, its ranks
interleaving three forms each round: `ring` (mpicomm.ring.Ring: messages through MPICH's shared memory);
`window-copy` (each rank copies its vector into its slot of one shared window, a node barrier, each rank sums its
block from every slot, a barrier); `window-inplace` (the same with the vector already in the slot: what a staging
buffer allocated in the window would give). Prints the slowest rank's median per form, milliseconds.
"""
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from mpicomm.buffers import block_counts, offsets
from mpicomm.ring import Ring

world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED)
L, j = node.Get_size(), node.Get_rank()
sizes = [int(s) for s in sys.argv[1].split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
ring = Ring(node)
most = max(sizes) // 4
win = MPI.Win.Allocate_shared(most * 4, 4, comm=node)
slots = [np.frombuffer(win.Shared_query(r)[0], dtype=np.float32, count=most) for r in range(L)]
win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch for Win.Sync; the node barriers order the writes and reads
FORMS = ("ring", "window-copy", "window-inplace")
for nbytes in sizes:
    n = nbytes // 4
    x = torch.randn(n)
    counts = block_counts(n, L)
    a = offsets(counts)[j]
    z = a + counts[j]
    out = torch.empty(counts[j])
    times = {f: [] for f in FORMS}
    for r in range(rounds + 1):  # the first round warms up
        for form in FORMS if r % 2 else reversed(FORMS):
            node.Barrier()
            t0 = time.perf_counter()
            if form == "ring":
                ring.reduce_scatter(x, out).wait()
            else:
                if form == "window-copy":
                    torch.from_numpy(slots[j][:n]).copy_(x)
                win.Sync()
                node.Barrier()  # every slot written
                win.Sync()
                out.copy_(torch.from_numpy(slots[0][a:z]))
                for k in range(1, L):
                    out.add_(torch.from_numpy(slots[k][a:z]))
                node.Barrier()  # every block read: the slots may be written again
            if r:
                times[form].append(time.perf_counter() - t0)
    worst = {f: world.allreduce(float(np.median(v)), op=MPI.MAX) for f, v in times.items()}
    if world.Get_rank() == 0:
        print(f"{nbytes:>10} B  " + "  ".join(f"{f} {1e3 * t:8.3f} ms" for f, t in worst.items()), flush=True)
win.Unlock_all()
win.Free()
ring.free()
node.Free()
