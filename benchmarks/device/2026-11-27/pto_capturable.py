"""Issue 29 finding 5 on CUDA: PTO with Adam(capturable=True), 3 steps, agreement with a plain Adam step."""
import sys, traceback
import torch
from mpi4py import MPI
from runtime.optimizer import DistributedOptimizer
rank = MPI.COMM_WORLD.Get_rank()
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
for cap in (False, True):
    try:
        opt = torch.optim.Adam(m.parameters(), lr=1e-3, capturable=cap)
        with DistributedOptimizer(opt, m, strategy=sys.argv[1], pto=True) as d:
            for _ in range(3):
                d.zero_grad()
                m(torch.randn(32, 256, device="cuda")).square().mean().backward()
                d.step()
            d.synchronize()
        print(f"rank {rank} capturable={cap} {sys.argv[1]}: OK", flush=True)
    except Exception as e:
        print(f"rank {rank} capturable={cap} {sys.argv[1]}: {type(e).__name__}: {str(e)[:300]}", flush=True)
