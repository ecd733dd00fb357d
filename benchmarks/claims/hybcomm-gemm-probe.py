"""hybcomm's GEMM probe as the strategy takes it at wrap on real compute: 4 ranks at once, one thread each, the slowest."""

import numpy as np
import torch
from mpi4py import MPI

from runtime.hybrid import cost_model

torch.set_num_threads(1)  # as the jobs' ranks run
world = MPI.COMM_WORLD
world.Barrier()  # every rank at work at once, as DistributedOptimizer's wrap does
mine = np.array([cost_model.measure_gflops()])
world.Allreduce(MPI.IN_PLACE, mine, op=MPI.MIN)
if world.Get_rank() == 0:
    print(f"{mine[0]:.1f}", flush=True)
