"""Benchmark: test accuracy of sparsified training (topk / hier-topk) against dense, same epochs and seeds.

    mpitrain bench convergence --json results/convergence.json
    mpitrain bench convergence --configs allreduce,topk:0.01,topk:0.01:117 --seeds 0,1 --epochs 2

Each configuration is `strategy`, `strategy:density` or
`strategy:density:ramp` (a DGC-style density ramp over that many steps,
from 0.25 down to the density); every one runs
`jobs.train` (Fashion-MNIST MLP, 4 ranks as 2 nodes x 2 ranks, so hier-topk
has a node level) once per seed. Prints a markdown table of the final test
accuracy per seed, the mean, and the gap to the dense baseline (the first
configuration); writes JSON rows and a PNG bar plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from jobs.common.choices import SPARSE_STRATEGIES, STRATEGIES
from jobs.common.compute import REAL_CPU, where_and_how, where_and_how_line
from jobs.common.inputs import (InputError, JobParser, at_least, check_fraction, comma_list, one_of, output_file, parse,
                                positive)
from jobs.common.outputs import write_together
from jobs.common.report import run_metadata, save_figure, write_json

# 117 steps: half of the first epoch of the default run (4 ranks x 64 samples per step).
DEFAULT_CONFIGS = ("allreduce,topk:0.01,hier-topk:0.01,topk:0.01:117,hier-topk:0.01:117,"
                   "topk:0.001,hier-topk:0.001,topk:0.001:117,hier-topk:0.001:117")


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.convergence", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma-separated strategy, strategy:density (topk, hier-topk) or strategy:density:ramp; the "
                        f"first is the baseline (default {DEFAULT_CONFIGS})")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one run each (default %(default)s)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run (default %(default)s)")
    p.add_argument("--ranks", type=int, default=4, help="ranks per run (default %(default)s)")
    p.add_argument("--ranks-per-node", type=int, default=2,
                   help="ranks per emulated node: hier-topk's node level (default %(default)s)")
    p.add_argument("--max-steps", type=int, default=0, help="steps per epoch (default %(default)s: all)")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds allowed per training run (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="write the rows and the run's metadata here (default: none)")
    p.add_argument("--plot", metavar="PNG", help="default: the JSON path with .png")
    return parse(p, argv, check_args)


def check_args(args) -> None:
    args.configs = comma_list("--configs", args.configs, parse=parse_config, unique=True)
    for config in args.configs:
        strategy, density, ramp = config
        one_of("--configs", strategy, STRATEGIES)
        # jobs.train takes a density (and its ramp) for the sparse strategies only: any other was run without it,
        # under a label that named it.
        if density is not None and strategy not in SPARSE_STRATEGIES:
            raise InputError("--configs", f"{strategy} sends every gradient: a density applies to "
                                          f"{' and '.join(SPARSE_STRATEGIES)} only")
        if density is not None:
            check_fraction("--configs", density)
        if ramp < 0:
            raise InputError("--configs", f"a ramp is a number of steps >= 0, got {ramp}")
        if ramp and density is None:
            raise InputError("--configs", f"{label(config)}: a ramp falls to a density: write "
                                          f"{strategy}:DENSITY:{ramp}")
    args.seeds = comma_list("--seeds", args.seeds, parse=int, unique=True)
    if min(args.seeds) < 0:
        raise InputError("--seeds", f"must be >= 0, got {min(args.seeds)}")
    at_least(args, 1, "epochs", "ranks", "ranks_per_node")
    at_least(args, 0, "max_steps")
    positive(args, "timeout")
    if args.ranks % args.ranks_per_node:
        raise InputError("--ranks-per-node", f"{args.ranks_per_node} does not divide --ranks {args.ranks}")
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "plot")


def parse_config(text: str) -> tuple[str, float | None, int]:
    """'strategy[:density[:ramp]]'; ValueError if a part is not a number or there are too many."""
    parts = text.split(":")
    if len(parts) > 3:
        raise ValueError("want strategy, strategy:density or strategy:density:ramp")
    strategy, density, ramp = (parts + ["", ""])[:3]
    return strategy, float(density) if density else None, int(ramp) if ramp else 0


def label(config) -> str:
    strategy, density, ramp = config
    text = strategy if density is None else f"{strategy} ρ={density:g}"
    return text + (f" ramp {ramp}" if ramp else "")


def run(args, config, seed) -> dict:
    """One training run; returns its last epoch's metrics."""
    from mpicomm.launch import mpiexec

    strategy, density, ramp = config
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "train.json")
        cmd = [mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "jobs.train", "--strategy", strategy,
               "--epochs", str(args.epochs), "--seed", str(seed), "--no-progress", "--json", out,
               "--max-steps", str(args.max_steps)]
        if density is not None:
            cmd += ["--density", str(density), "--density-ramp-steps", str(ramp)]
        env = dict(os.environ, MPITRAIN_RANKS_PER_NODE=str(args.ranks_per_node))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode:
            raise RuntimeError(f"{label(config)} seed {seed} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)["epochs"][-1]


def table(rows, configs, seeds) -> str:
    base = statistics.fmean(r["test_accuracy"] for r in rows if r["config"] == label(configs[0]))
    head = ("| configuration | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | vs " + label(configs[0])
            + " |\n|---|" + "---:|" * (len(seeds) + 2))
    body = []
    for c in configs:
        accs = [r["test_accuracy"] for r in rows if r["config"] == label(c)]
        mean = statistics.fmean(accs)
        body.append(f"| {label(c)} | " + " | ".join(f"{a * 100:.2f} %" for a in accs)
                    + f" | {mean * 100:.2f} % | {(mean - base) * 100:+.2f} points |")
    return "\n".join([head, *body])


def plot(rows, configs, path, meta: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [label(c) for c in configs]
    accs = [[r["test_accuracy"] * 100 for r in rows if r["config"] == n] for n in names]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.6 * len(names) + 2), 3.8))  # wide enough for the machine line
    ax.bar(range(len(names)), [statistics.fmean(a) for a in accs], color="#4c72b0")
    for i, a in enumerate(accs):
        ax.scatter([i] * len(a), a, color="black", s=12, zorder=3)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylim(min(min(a) for a in accs) - 3, 100)
    ax.set_ylabel("test accuracy %")
    ax.set_title(f"Fashion-MNIST MLP, final epoch (dots: seeds)\n{where_and_how_line(meta)}", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    try:
        for config in args.configs:
            for seed in args.seeds:
                print(f"# {label(config)}, seed {seed} ...", flush=True)
                last = run(args, config, seed)
                rows.append(dict(config=label(config), strategy=config[0], density=config[1], ramp_steps=config[2],
                                 seed=seed,
                                 epochs=args.epochs, test_accuracy=last["test_accuracy"], loss=last["loss"],
                                 samples_per_s=last["samples_per_s"]))
                print(f"  test accuracy {last['test_accuracy'] * 100:.2f} %", flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meta = run_metadata("jobs.bench.convergence", argv, **where_and_how(REAL_CPU))  # jobs.train on the CPU
    print(f"\n{where_and_how_line(meta)}\n" + table(rows, args.configs, args.seeds))
    if args.json:
        write_together(None, "--json", args.json, lambda: write_json(args.json, meta, rows))
    if args.plot:
        write_together(None, "--plot", args.plot,
                       lambda: (plot(rows, args.configs, args.plot, meta), print(f"wrote {args.plot}")))
    return 0


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
