"""Soak: thousands of training steps under one strategy, watching memory, threads and MPI requests for leaks.

    mpiexec -n 4 mpitrain soak --steps 2000 --json results/soak-p3.json

Every --every steps each rank samples its resident memory (VmRSS), its
threads (/proc/self/task) and the MPI requests the runtime has in flight,
after a synchronize() (the runtime keeps one receive posted per optimizer: the
failure beacon). Prints a table of samples (the largest value over ranks),
and the verdict: RSS growth from the first sample after --settle steps to the
last, against --max-growth; threads and requests must not grow at all, and
after close() no request may be left. Exit 1 when a bound is exceeded.
Rank 0 prints each sample as it is taken (and the step every 10 s between
samples). --json writes the samples as rows, --plot (by default the JSON
path with .png) their RSS; without either, nothing is written.
"""

from __future__ import annotations

import argparse
import os
import time

from jobs.common.choices import STRATEGIES
from jobs.common.inputs import InputError, JobParser, at_least, output_file, parse, positive
from jobs.common.outputs import write_results
from jobs.common.report import run_metadata, save_figure


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.soak", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--strategy", default="p3", choices=STRATEGIES)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=100, help="steps between samples (default 100)")
    p.add_argument("--settle", type=int, default=100, help="steps before the baseline sample (default 100)")
    p.add_argument("--max-growth", type=float, default=0.05, help="allowed RSS growth (default 0.05 = 5 %%)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG", help="default: the JSON path with .png")
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    at_least(args, 1, "steps", "every", "batch_size")
    if not 0 <= args.settle < args.steps:
        raise InputError("--settle", f"must be in [0, --steps), got {args.settle}")
    positive(args, "max_growth")
    after = [s for s in sample_steps(args) if s >= args.settle]
    if len(after) < 2:  # growth needs a baseline and a later sample; with one it is 0 and "ok" says nothing
        raise InputError("--every", f"{len(after)} sample(s) from step --settle {args.settle} to --steps "
                                    f"{args.steps} every {args.every}: the verdict needs at least two (lower --every "
                                    f"or raise --steps)")
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "plot")


def sample_steps(args) -> list[int]:
    """The steps after which main samples: every --every, and --settle (the baseline) if it is a step."""
    return sorted(set(range(args.every, args.steps + 1, args.every)) | ({args.settle} if args.settle else set()))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main(argv=None, args=None) -> int:
    args = args or parse_args(argv)
    import numpy as np
    import torch
    from mpi4py import MPI

    from mpicomm.requests import live_requests
    from runtime import DistributedOptimizer
    from runtime.workloads.models import build_model, loss_fn, model_input

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.manual_seed(0)
    model = build_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = model_input("mlp", args.batch_size * 8, seed=rank)
    loss = loss_fn("mlp")
    dopt = DistributedOptimizer(opt, model, args.strategy)
    samples = []
    sampled = set(sample_steps(args))
    said = time.monotonic()
    for step in range(1, args.steps + 1):
        i = (step % 8) * args.batch_size
        dopt.zero_grad()
        loss(model(x[0][i:i + args.batch_size]), y[i:i + args.batch_size]).backward()
        dopt.step()
        if step in sampled:
            dopt.synchronize()
            mine = np.array([rss_bytes(), threads(), live_requests()], dtype=np.int64)
            comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
            samples.append(dict(step=step, rss_mb=mine[0] / 2**20, threads=int(mine[1]), requests=int(mine[2])))
            if rank == 0:
                s = samples[-1]
                print(f"# step {step}/{args.steps}: RSS {s['rss_mb']:.1f} MB, {s['threads']} threads, "
                      f"{s['requests']} requests in flight", flush=True)
                said = time.monotonic()
        elif rank == 0 and time.monotonic() - said > 10:  # a long --every: still a sign of life
            print(f"# step {step}/{args.steps}", flush=True)
            said = time.monotonic()
    dopt.close()
    left = np.array([live_requests()], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, left, op=MPI.MAX)
    samples.sort(key=lambda s: s["step"])
    base = next(s for s in samples if s["step"] >= args.settle)
    last = samples[-1]
    growth = last["rss_mb"] / base["rss_mb"] - 1
    thread_growth = last["threads"] - base["threads"]
    request_growth = max(s["requests"] for s in samples if s["step"] >= base["step"]) - base["requests"]
    ok = growth < args.max_growth and thread_growth <= 0 and request_growth <= 0 and left[0] == 0
    if rank == 0:
        print("| step | RSS MB (max over ranks) | threads | MPI requests in flight |\n|---:|---:|---:|---:|")
        for s in samples:
            print(f"| {s['step']} | {s['rss_mb']:.1f} | {s['threads']} | {s['requests']} |")
        print(f"\n{args.strategy}, {comm.Get_size()} ranks, {args.steps} steps: RSS {growth * 100:+.2f} % from step "
              f"{base['step']} (bound {args.max_growth * 100:g} %), threads {thread_growth:+d}, "
              f"requests {request_growth:+d}, {int(left[0])} left after close() -> {'ok' if ok else 'LEAK'}")
    write_results(comm, args, run_metadata("jobs.soak", argv, ranks=comm.Get_size()),
                  [dict(s, strategy=args.strategy) for s in samples], lambda path: plot(samples, path, args.strategy),
                  say=print if rank == 0 else (lambda *a, **k: None))
    return 0 if ok else 1


def plot(samples, path, strategy):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s["step"] for s in samples], [s["rss_mb"] for s in samples], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("RSS MB (max over ranks)")
    ax.set_title(f"soak: {strategy}")
    ax.grid(True, alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before torch and MPI start
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
