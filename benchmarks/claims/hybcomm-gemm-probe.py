"""hybcomm's GEMM probe as the strategy takes it at wrap on real compute: 4 ranks at once, one thread each, the slowest."""

import numpy as np, torch
from mpi4py import MPI
from runtime.hybrid import cost_model
torch.set_num_threads(1)
w = MPI.COMM_WORLD
w.Barrier()
mine = np.array([cost_model.measure_gflops()])
w.Allreduce(MPI.IN_PLACE, mine, op=MPI.MIN)
if w.Get_rank() == 0:
    print("%.1f" % mine[0], flush=True)
