"""p3's exchange alone: ResNet-50 224's gradient (one flat buffer, its tensors' sizes, forward priorities), every
tensor handed over at once in backward order, the progress loop in this thread; seconds per step.

    mpitrain cluster run -n 8 -- python benchmarks/claims/p3_exchange_alone.py SLICE_ELEMENTS CREDIT
"""
import sys
import time

import torch
from mpi4py import MPI
from mpicomm.sliced_ps import SlicedExchange
from runtime.workloads.models import build_model

world = MPI.COMM_WORLD
sizes = [p.numel() for p in build_model("resnet50-224", num_classes=1000).parameters()]
buf = torch.ones(sum(sizes))
segs, a = [], 0
for n in sizes:
    segs.append((0, a, a + n))
    a += n
ex = SlicedExchange(world, [buf], segs, int(sys.argv[1]), credit=int(sys.argv[2]), relaxed_sleep=100e-6)
ex.set_priorities(list(range(len(sizes))))
times = []
for step in range(4):
    world.Barrier()
    t0 = time.perf_counter()
    ex.begin()
    for t in reversed(range(len(sizes))):
        ex.ready(t)
    while not ex.poll():
        time.sleep(50e-6)
    world.Barrier()
    times.append(time.perf_counter() - t0)
ex.free()
if world.Get_rank() == 0:
    print("steps s:", " ".join(f"{x:.3f}" for x in times), flush=True)
