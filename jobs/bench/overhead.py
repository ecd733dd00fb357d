"""Benchmark: what the runtime itself costs per step and per wrap, with no network in the way.

    mpiexec -n 1 mpitrain bench overhead --models resnet50,transformer --json results/overhead.json
    mpiexec -n 4 mpitrain bench overhead --models mlp --steps 0 --json results/wrap.json   # wrap time

On one rank no byte is exchanged, so a strategy's step time minus the plain
torch step (same model, same batch) is the runtime's own work: hooks, the
gradients' copies, p3's per-layer updates, the per-step agreement. Every
round builds each configuration afresh, in a rotating order, and times
--steps steps after --warmup; the table gives the median over rounds of each
configuration's median step, the wrap (construction) time, and the overhead
against plain torch. With more than one rank it also times the per-step
agreement round (mpicomm.step_check) against a native Allreduce of the same
vector. Rank 0 prints each round's step times as it ends. Writes JSON rows and
a PNG (real compute, one thread per rank; --steps 0 times no step, so draws none).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from jobs.common.choices import MODELS
from jobs.common.inputs import InputError, JobParser, at_least, comma_list, output_file, parse
from jobs.common.outputs import write_results
from jobs.common.report import run_metadata, save_figure

CONFIGS = ("plain", "allreduce", "wfbp", "p3", "topk")


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.overhead", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", default="resnet50,transformer",
                   help="runtime.workloads.models names (default resnet50,transformer)")
    p.add_argument("--strategies", default=",".join(CONFIGS[1:]), help="compared with plain torch")
    p.add_argument("--batch-size", type=int, default=8, help="samples per step (default 8)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (0: wrap time only)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG", help="default: the JSON path with .png")
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    args.models = comma_list("--models", args.models, MODELS)
    args.configs = ["plain"] + comma_list("--strategies", args.strategies, CONFIGS[1:])
    at_least(args, 1, "batch_size", "rounds")
    at_least(args, 0, "steps", "warmup")
    if not args.steps and args.plot is not None:  # it used to be dropped silently
        raise InputError("--plot", "--steps 0 times the wrap only: no step times to draw (drop --plot, or give "
                                   "--steps)")
    if args.plot is None and args.json and args.steps:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "plot")


def measure(args, model_name, config, comm):
    """(wrap seconds, median step seconds) of one configuration, slowest rank."""
    import numpy as np
    import torch
    from mpi4py import MPI

    from runtime import DistributedOptimizer
    from runtime.workloads.models import build_model, loss_fn, model_input

    torch.manual_seed(0)
    model = build_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    inputs, target = model_input(model_name, args.batch_size, comm.Get_rank())
    loss = loss_fn(model_name)
    comm.Barrier()
    t0 = time.perf_counter()
    dopt = opt if config == "plain" else DistributedOptimizer(opt, model, config)
    wrap = time.perf_counter() - t0
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        dopt.zero_grad()
        loss(model(*inputs), target).backward()
        dopt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if config != "plain":
        dopt.synchronize()
        dopt.close()
    slowest = np.array([wrap, statistics.median(times) if times else 0.0])
    comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
    return float(slowest[0]), float(slowest[1])


def agreement_cost(comm, nbits: int = 160, calls: int = 500, rounds: int = 5) -> tuple[float, float]:
    """Median seconds of one step-agreement round and of a native Allreduce of the same vector."""
    import numpy as np
    from mpi4py import MPI

    from mpicomm.step_check import StepCheck

    check = StepCheck(comm, nbits=nbits)
    used = np.ones(nbits, dtype=bool)
    vec = np.zeros(8 + nbits, dtype=np.int64)
    out = np.zeros_like(vec)
    ours, native = [], []
    for _ in range(rounds):  # interleaved, so that the machine's mood cannot decide the ratio
        comm.Barrier()
        t0 = time.perf_counter()
        for i in range(calls):
            check.run(1, i, 12345, used)
        ours.append((time.perf_counter() - t0) / calls)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            comm.Allreduce(vec, out, op=MPI.MAX)
        native.append((time.perf_counter() - t0) / calls)
    check.free()
    return statistics.median(ours), statistics.median(native)


def main(argv=None, args=None) -> int:
    args = args or parse_args(argv)
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    say = print if comm.Get_rank() == 0 else (lambda *a, **k: None)
    rows = []
    for model_name in args.models:
        samples = {c: [] for c in args.configs}
        for r in range(args.rounds):
            order = args.configs[r % len(args.configs):] + args.configs[:r % len(args.configs)]
            for config in order:
                samples[config].append(measure(args, model_name, config, comm))
            last = {c: samples[c][-1] for c in args.configs}  # (wrap s, step s)
            say(f"# {model_name}, round {r + 1}/{args.rounds}: " + ", ".join(
                f"{c} {last[c][1] * 1e3:.1f} ms" if args.steps else f"{c} wrap {last[c][0]:.3f} s"
                for c in args.configs), flush=True)
        plain = statistics.median(s for _, s in samples["plain"])
        for config in args.configs:
            wrap = statistics.median(w for w, _ in samples[config])
            step = statistics.median(s for _, s in samples[config])
            rows.append(dict(model=model_name, strategy=config, ranks=comm.Get_size(), rounds=args.rounds,
                             wrap_s=wrap, step_s=step, overhead_s=step - plain))
    say("| model | strategy | ranks | wrap s | step ms | overhead vs plain ms |\n|---|---|---:|---:|---:|---:|")
    for r in (r for r in rows if "step_s" in r):
        say(f"| {r['model']} | {r['strategy']} | {r['ranks']} | {r['wrap_s']:.3f} | {r['step_s'] * 1e3:.1f} | "
            f"{r['overhead_s'] * 1e3:+.1f} |")
    if comm.Get_size() > 1:
        ours, native = agreement_cost(comm)
        rows.append(dict(model="-", strategy="step agreement", ranks=comm.Get_size(), agreement_s=ours,
                         native_allreduce_s=native))
        say(f"step agreement: {ours * 1e6:.0f} us per round (a native Allreduce of the same vector: "
            f"{native * 1e6:.0f} us)")
    write_results(comm, args, run_metadata("jobs.bench.overhead", argv), rows, lambda path: plot(rows, path), say)
    return 0


def plot(rows, path):
    save_figure(figure(rows), path)


def figure(rows):
    """A panel per model: each configuration's step time, titled with the ranks it ran on and the compute."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "step_s" in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        ax.bar([r["strategy"] for r in mine], [r["step_s"] * 1e3 for r in mine])
        ranks = mine[0]["ranks"]
        ax.set_title(f"{model}: step time, {ranks} rank{'s' * (ranks > 1)}\n(real compute, CPU, one thread each)",
                     fontsize=9)
        ax.set_ylabel("ms")
    return fig


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before torch and MPI start
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
