"""A user's own training script, launched as `mpiexec -n 4 python failstop_script.py MODE STRATEGY`, that goes
wrong on one rank in the way MODE says (tests/test_failstop.py runs it; not a test module itself)."""

import io
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

from runtime import DistributedOptimizer

mode, strategy = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "p3"
rank = MPI.COMM_WORLD.Get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
x, y = torch.randn(64, 20), torch.randint(0, 4, (64,))

if "pipeline" in (mode, strategy):  # "pipeline": stage 1 fails; "catch-interrupt pipeline": the loop below's
    from runtime.pipeline import Pipeline

    fails = mode == "pipeline"
    balance, pipe_mode, steps = ([2, 1, 1, 1], "flush", 40) if fails else ([3, 2], "spectrain", 10 ** 9)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    pipe = Pipeline(model, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), loss_fn=F.cross_entropy,
                    balance=balance, microbatches=4, mode=pipe_mode)
    try:
        for step in range(steps):
            if fails and step == 20 and rank == 1:
                raise OSError("disk gone")
            if not fails and step == 5:
                print(f"[rank {rank}] training, pid {os.getpid()}", flush=True)
            pipe.train_step(x, y)
    except KeyboardInterrupt as exc:  # as the loop below, with the pipeline's abort
        pipe.abort(exc)
        torch.save(pipe.state_dict(), io.BytesIO())
        print(f"[rank {rank}] caught ^C, saved", flush=True)
    pipe.close()
    print(f"[rank {rank}] done", flush=True)
    sys.exit(0)

if mode == "before-wrap" and rank == 1:
    raise OSError("disk gone")
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                           "nope" if mode == "unknown-strategy" and rank == 1 else strategy)
steps = 9 if mode.startswith("uneven") and rank == 3 else 10 if mode.startswith("uneven") else \
    10 ** 9 if mode.endswith("interrupt") else 40  # interrupt: until ^C
if mode in ("uneven-on", "close-early"):  # the others train on past rank 3's last step (p3: their next forward
    steps = 9 if rank == 3 else 12       # waits for the step's slices, which need rank 3's pushes)


def train():
    for step in range(steps):
        if mode.endswith("interrupt") and step == 5:
            print(f"[rank {rank}] training, pid {os.getpid()}", flush=True)
        if mode == "raise" and step == 20 and rank == 1:
            raise OSError("disk gone")
        if mode == "exit" and step == 5 and rank == 2:
            sys.exit(0)
        opt.zero_grad()
        F.cross_entropy(model(x[rank * 16:(rank + 1) * 16]), y[rank * 16:(rank + 1) * 16]).backward()
        opt.step()


if mode == "catch-interrupt":  # the README's loop that saves on ^C
    try:
        train()
    except KeyboardInterrupt as exc:  # this rank's ^C, or another rank's heard first (PeerInterruptedError)
        opt.abort(exc)  # nothing more is agreed: ranks may have stopped a step apart
        torch.save(model.state_dict(), io.BytesIO())
        print(f"[rank {rank}] caught ^C, saved", flush=True)
else:
    train()
if mode in ("uneven", "uneven-on"):  # the README's evaluation: a metric summed over ranks, agreed like a step
    print(f"[rank {rank}] sums {opt.sum_over_ranks([1.0, 2.0]).tolist()}", flush=True)
elif mode == "uneven-allreduce":  # the user's own collective: only the stall limit can name the rank
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, torch.zeros(2).numpy())
if mode != "no-close":
    opt.close()
print(f"[rank {rank}] done", flush=True)
