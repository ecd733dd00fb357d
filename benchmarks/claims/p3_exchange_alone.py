"""p3's exchange alone: a model's gradient (one flat buffer, its tensors' sizes, forward priorities), every tensor
handed over at once in backward order, the progress loop in this thread; seconds per step.

    mpitrain cluster run -n 8 -- python benchmarks/claims/p3_exchange_alone.py SLICE_ELEMENTS CREDIT

Environment: MODEL (default resnet50-224), NODES=1 (aggregate inside each node, as the runtime does; the nodes
are mpicomm.Topology's), LOCAL_RATE (bytes a second of pushes inside a node; 0: unpaced), RELAXED
(seconds between polls while nothing completes; default 100e-6), STEPS (default 4; the first is a warm-up),
WINDOW=1 (the node's pushes and results through an MPI-3 shared window: mpicomm.node_window).
Rank 0 prints the steps' seconds, the bytes across each node's link, and all ranks' CPU-seconds and polls.
"""
import os
import resource
import sys
import time

import torch
from mpi4py import MPI
from mpicomm.sliced_ps import SlicedExchange
from mpicomm.topology import Topology
from runtime.workloads.models import build_model

world = MPI.COMM_WORLD
nodes = None
if os.environ.get("NODES") == "1":
    topology = Topology(world)  # the nodes as the runtime finds them
    nodes = topology.nodes
    topology.free()
sizes = [p.numel() for p in build_model(os.environ.get("MODEL", "resnet50-224"), num_classes=1000).parameters()]
buf = torch.ones(sum(sizes))
segs, a = [], 0
for n in sizes:
    segs.append((0, a, a + n))
    a += n
ex = SlicedExchange(world, [buf], segs, int(sys.argv[1]), credit=int(sys.argv[2]),
                    relaxed_sleep=float(os.environ.get("RELAXED", 100e-6)), nodes=nodes,
                    local_rate=float(os.environ.get("LOCAL_RATE", 0)) or None,
                    node_window=os.environ.get("WINDOW") == "1")
ex.set_priorities(list(range(len(sizes))))
times = []
for step in range(int(os.environ.get("STEPS", 4))):
    world.Barrier()
    t0 = time.perf_counter()
    ex.begin()
    for t in reversed(range(len(sizes))):
        ex.ready(t)
    while not ex.poll():
        time.sleep(ex.idle_sleep())
    world.Barrier()
    times.append(time.perf_counter() - t0)
cross = world.reduce(ex.cross_bytes)
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu, polls = world.reduce(usage.ru_utime + usage.ru_stime), world.reduce(ex.polls)  # CPU: start-up included
ex.free()
if world.Get_rank() == 0:
    steady = sorted(times[1:] or times)
    per_host = cross / len(nodes or [[0]] * world.Get_size()) / len(times)
    print("steps s:", " ".join(f"{x:.3f}" for x in times), f"| median after the first {steady[len(steady) // 2]:.3f} s,"
          f" {per_host / 1e6:.0f} MB a step across each node's link; all ranks: {cpu:.1f} CPU-s (start-up included),"
          f" {polls} polls", flush=True)
