"""Benchmark: PTO's sharded optimizer step (1/P update + parameter allgather) against the unsharded step on every rank.

    mpiexec -n 4 mpitrain bench pto --json results/pto-vgg19.json

With random gradients on the VGG-19-shaped model (38.9 M parameters) and one
torch thread per rank, times `optimizer.step()` over all parameters (what
every rank does without PTO) and `ShardedUpdate.step()` split into its shard
update and its allgather. Each figure is the median over --repeats of the
slowest rank's time, after --warmup untimed steps. Prints a markdown table,
writes JSON rows (model, optimizer, ranks, unsharded_step_s, pto_step_s,
pto_update_s, pto_allgather_s, speedup) and a PNG bar plot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from jobs.common.choices import MODELS
from jobs.common.inputs import JobParser, at_least, comma_list, one_of, output_file, parse
from jobs.common.outputs import write_results
from jobs.common.report import run_metadata, save_figure

OPTIMIZERS = {
    "adam": ("Adam", dict(lr=1e-3)),
    "sgd-momentum": ("SGD", dict(lr=0.01, momentum=0.9)),
}


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.pto", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vgg19", help="a runtime.workloads.models name (default vgg19)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help=f"comma-separated subset of {','.join(OPTIMIZERS)}")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per row (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2; the first builds state)")
    p.add_argument("--json", metavar="PATH", help="write the rows (and run metadata) here")
    p.add_argument("--plot", metavar="PNG", help="bar plot (default: the JSON path with .png)")
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    one_of("--model", args.model, MODELS)
    args.optimizers = comma_list("--optimizers", args.optimizers, OPTIMIZERS)
    at_least(args, 1, "repeats")
    at_least(args, 0, "warmup")
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "plot")


def make_optimizer(name, params):
    import torch

    cls, kw = OPTIMIZERS[name]
    return getattr(torch.optim, cls)(params, **kw)


def timed(comm, phases, repeats, warmup):
    """Median over repeats of the slowest rank's seconds for each phase (a list of callables run in order).

    Also returns the median of the slowest rank's total, which is not the sum
    of the phase medians when ranks are slow at different phases.
    """
    import numpy as np
    from mpi4py import MPI

    for _ in range(warmup):
        for fn in phases:
            fn()
    samples = []
    for _ in range(repeats):
        comm.Barrier()  # every rank starts the step together, as after a gradient collective
        marks = [time.perf_counter()]
        for fn in phases:
            fn()
            marks.append(time.perf_counter())
        local = np.diff(marks).tolist() + [marks[-1] - marks[0]]
        worst = np.empty(len(local))
        comm.Allreduce(np.array(local), worst, op=MPI.MAX)
        samples.append(worst)
    return [statistics.median(s[i] for s in samples) for i in range(len(phases) + 1)]


def format_table(rows) -> str:
    lines = ["| model | optimizer | ranks | unsharded step (ms) | PTO step (ms) | PTO update (ms) "
             "| PTO allgather (ms) | speedup |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['optimizer']} | {r['ranks']} | {r['unsharded_step_s'] * 1e3:.1f} "
              f"| {r['pto_step_s'] * 1e3:.1f} | {r['pto_update_s'] * 1e3:.1f} | {r['pto_allgather_s'] * 1e3:.1f} "
              f"| {r['speedup']:.2f}x |" for r in rows]
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.8 + 2.4 * len(rows), 3.8))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["unsharded_step_s"] * 1e3 for r in rows], 0.4, label="unsharded step")
    update = [r["pto_update_s"] * 1e3 for r in rows]
    ax.bar([x + 0.2 for x in xs], update, 0.4, label="PTO: 1/P update")
    ax.bar([x + 0.2 for x in xs], [r["pto_allgather_s"] * 1e3 for r in rows], 0.4, bottom=update,
           label="PTO: allgather")
    ax.set_xticks(list(xs), [f"{r['optimizer']}\n{r['speedup']:.2f}x" for r in rows])
    ax.set_ylabel("ms per step (slowest rank, median)")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    import torch
    from mpi4py import MPI  # here, not at import: importing a job must not start MPI

    from runtime.pto import ShardedUpdate
    from runtime.workloads.models import build_model

    torch.set_num_threads(1)  # one core per rank, as ranks share the host's cores
    comm = MPI.COMM_WORLD
    P, rank = comm.Get_size(), comm.Get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    if P == 1:
        say("note: 1 rank: PTO is the unsharded update plus copies; run under `mpiexec -n 4`")
    torch.manual_seed(0)
    model = build_model(args.model)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    say(f"# {args.model}: {n / 1e6:.1f} M parameters, {P} ranks, torch threads 1, "
        f"{args.warmup} warm-up + median of {args.repeats}", flush=True)
    rows = []
    for name in args.optimizers:
        # The two are timed one after the other so that only one full optimizer state is alive at a time.
        opt = make_optimizer(name, params)
        unsharded, _ = timed(comm, [opt.step], args.repeats, args.warmup)
        del opt
        opt = make_optimizer(name, params)
        pto = ShardedUpdate(opt, params, comm)
        update, allgather, step = timed(comm, [pto.update_shard, pto.allgather_params], args.repeats, args.warmup)
        pto.close()
        del pto, opt
        rows.append(dict(model=args.model, optimizer=name, ranks=P, params=n, unsharded_step_s=unsharded,
                         pto_step_s=step, pto_update_s=update, pto_allgather_s=allgather,
                         speedup=unsharded / step))
    say(format_table(rows))
    meta = run_metadata("jobs.bench.pto", argv, mpi=MPI.Get_library_version().splitlines()[0].strip(), ranks=P,
                        torch=torch.__version__, threads=1, repeats=args.repeats, warmup=args.warmup)
    title = f"PTO vs unsharded step, {args.model}, {P} ranks"
    write_results(comm, args, meta, rows, lambda path: plot(rows, path, title), say)
    return 0


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before torch and MPI start
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
