"""Benchmark: PTO's sharded optimizer step (1/P update + parameter allgather) against the unsharded step on every rank.

    mpiexec -n 4 mpitrain bench pto --json results/pto-vgg19.json

With random gradients on the VGG-19-shaped model (38.9 M parameters) and one
torch thread per rank, times `optimizer.step()` over all parameters (what
every rank does without PTO) and `ShardedUpdate.step()` split into its shard
update and its allgather, each on its own copy of the parameters. They are
timed in --rounds rounds, both in each round, in alternating order (the
unsharded step first in even rounds, PTO first in odd ones), so that a
change in the machine's load moves both alike; a round's figure for each is
the median over --repeats steps of the slowest rank's time, after --warmup
untimed steps of each. The speed-up is the median of the per-round ratios
(unsharded / PTO) with its order-statistic CI; the times are medians over
rounds. Prints a markdown table, writes JSON rows (model, optimizer, ranks,
unsharded_step_s, pto_step_s, pto_update_s, pto_allgather_s, speedup,
speedup_ci, speedup_coverage, round_ratios, round_orders) and a PNG bar plot,
each naming the machine and the compute (real, CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from jobs.common.choices import MODELS
from jobs.common.inputs import JobParser, at_least, comma_list, one_of, output_file, parse
from jobs.common.outputs import write_results
from jobs.common.compute import REAL_CPU, where_and_how, where_and_how_line
from jobs.common.report import run_metadata, save_figure
from jobs.common.stats import coverage_text, median_ci

OPTIMIZERS = {
    "adam": ("Adam", dict(lr=1e-3)),
    "sgd-momentum": ("SGD", dict(lr=0.01, momentum=0.9)),
}


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.pto", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vgg19", help="a runtime.workloads.models name (default vgg19)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help=f"comma-separated subset of {','.join(OPTIMIZERS)} (default %(default)s)")
    p.add_argument("--rounds", type=int, default=7,
                   help="rounds per optimizer, both steps timed in each, in alternating order; the speed-up is the "
                        "median of the per-round ratios (default 7; 95 %% CIs from 6)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed steps of each contender per round, their median the round's figure (default 3)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps of each first (default 2; the first builds state)")
    p.add_argument("--json", metavar="PATH", help="write the rows (and run metadata) here")
    p.add_argument("--plot", metavar="PNG", help="bar plot (default: the JSON path with .png)")
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    one_of("--model", args.model, MODELS)
    args.optimizers = comma_list("--optimizers", args.optimizers, OPTIMIZERS)
    at_least(args, 1, "repeats", "rounds")
    at_least(args, 0, "warmup")
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "plot")


def make_optimizer(name, params):
    import torch

    cls, kw = OPTIMIZERS[name]
    return getattr(torch.optim, cls)(params, **kw)


def timed(comm, phases, repeats):
    """Median over repeats of the slowest rank's seconds for each phase (a list of callables run in order).

    Also returns the median of the slowest rank's total, which is not the sum
    of the phase medians when ranks are slow at different phases.
    """
    import numpy as np
    from mpi4py import MPI

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


def contend(comm, contenders: dict, rounds: int, repeats: int) -> tuple[dict, list]:
    """({name: [each round's timed() figures]}, [each round's order]): every contender timed in every round, the
    order alternating (reversed in odd rounds), so that neither always runs first, nor in a calmer stretch."""
    names = list(contenders)
    times, orders = {n: [] for n in names}, []
    for rnd in range(rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        orders.append(order)
        for name in order:
            times[name].append(timed(comm, contenders[name], repeats))
    return times, orders


def fresh_params(params, grads):
    """A copy of the parameters with the same gradients: each contender steps its own, so neither reads the
    other's writes (PTO re-reads parameters changed between its steps, which would add to its time)."""
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for c, g in zip(copies, grads):
        c.grad = g.clone()
    return copies


def format_table(rows, meta: dict) -> str:
    rounds = meta["rounds"]
    lines = [f"{where_and_how_line(meta)}; {rounds} rounds, speed-up: the median of the per-round ratios, "
             f"{coverage_text(rounds)}", "",
             "| model | optimizer | ranks | unsharded step (ms) | PTO step (ms) | PTO update (ms) "
             "| PTO allgather (ms) | speedup | (CI) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['model']} | {r['optimizer']} | {r['ranks']} | {r['unsharded_step_s'] * 1e3:.1f} "
              f"| {r['pto_step_s'] * 1e3:.1f} | {r['pto_update_s'] * 1e3:.1f} | {r['pto_allgather_s'] * 1e3:.1f} "
              f"| {r['speedup']:.2f}x | {r['speedup_ci'][0]:.2f}-{r['speedup_ci'][1]:.2f} |" for r in rows]
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.5, 1.8 + 2.4 * len(rows)), 3.8))  # the title's machine line fits
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["unsharded_step_s"] * 1e3 for r in rows], 0.4, label="unsharded step")
    update = [r["pto_update_s"] * 1e3 for r in rows]
    ax.bar([x + 0.2 for x in xs], update, 0.4, label="PTO: 1/P update")
    ax.bar([x + 0.2 for x in xs], [r["pto_allgather_s"] * 1e3 for r in rows], 0.4, bottom=update,
           label="PTO: allgather")
    ax.set_xticks(list(xs), [f"{r['optimizer']}\n{r['speedup']:.2f}x ({r['speedup_ci'][0]:.2f}-"
                             f"{r['speedup_ci'][1]:.2f})" for r in rows])
    ax.set_ylabel("ms per step (slowest rank, median)")
    ax.set_xlabel(f"optimizer; speed-up: median of per-round ratios ({coverage_text(rows[0]['rounds'])})", fontsize=8)
    ax.set_title(title, fontsize=8)
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
    grads = [torch.randn(p.shape, generator=g) for p in params]
    say(f"# {args.model}: {n / 1e6:.1f} M parameters, {P} ranks, torch threads 1, {args.warmup} warm-up, "
        f"{args.rounds} rounds of {args.repeats} steps each, alternating", flush=True)
    meta = run_metadata("jobs.bench.pto", argv, mpi=MPI.Get_library_version().splitlines()[0].strip(), ranks=P,
                        torch=torch.__version__, threads=1, rounds=args.rounds, repeats=args.repeats,
                        warmup=args.warmup, **where_and_how(REAL_CPU))
    rows = []
    for name in args.optimizers:
        # Both alive at once, each on its own copy of the parameters, so that they can alternate round by round.
        own, shared = fresh_params(params, grads), fresh_params(params, grads)
        opt = make_optimizer(name, own)
        pto = ShardedUpdate(make_optimizer(name, shared), shared, comm)
        contenders = {"unsharded": [opt.step], "pto": [pto.update_shard, pto.allgather_params]}
        for _ in range(args.warmup):
            for phases in contenders.values():
                for fn in phases:
                    fn()
        times, orders = contend(comm, contenders, args.rounds, args.repeats)
        pto.close()
        del pto, opt, own, shared
        ratios = [u[-1] / p[-1] for u, p in zip(times["unsharded"], times["pto"])]  # paired: the same round
        low, high, coverage = median_ci(ratios)
        unsharded = statistics.median(t[-1] for t in times["unsharded"])
        update, allgather, step = (statistics.median(t[i] for t in times["pto"]) for i in range(3))
        rows.append(dict(model=args.model, optimizer=name, ranks=P, params=n, unsharded_step_s=unsharded,
                         pto_step_s=step, pto_update_s=update, pto_allgather_s=allgather,
                         speedup=statistics.median(ratios), speedup_ci=[low, high], speedup_coverage=coverage,
                         round_ratios=ratios, round_orders=orders, rounds=args.rounds))
    say(format_table(rows, meta))
    title = f"PTO vs unsharded step, {args.model}, {P} ranks, {args.rounds} rounds\n{where_and_how_line(meta)}"
    write_results(comm, args, meta, rows, lambda path: plot(rows, path, title), say)
    return 0


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before torch and MPI start
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
