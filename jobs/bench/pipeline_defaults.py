"""Benchmark: `mpitrain train --parallel pipeline` at its defaults, every mode against flush, test accuracy per seed.

    mpitrain bench pipeline-defaults --json benchmarks/pipeline-defaults/after.json
    mpitrain bench pipeline-defaults --models mlp --modes flush,spectrain --seeds 0 --baseline before.json

Each run is the training job itself, as a user starts it with nothing but
the mode, the model and the seed (its defaults otherwise: Fashion-MNIST,
batch 64 per step as 4 micro-batches of 16, --lr 0.05, momentum 0.9, the
automatic partition):

    mpiexec -n RANKS python -m jobs.train --parallel pipeline --pipeline-mode MODE --model MODEL \\
        --stages RANKS --epochs EPOCHS --seed SEED

Prints a markdown table of the last epoch's test accuracy per seed, the
mean and its gap to flush (the synchronous mode, equal to one process); with
--baseline, an earlier run's means beside them (before a change). A run
that stops (the job's divergence stop, exit 3) is a row marked "stopped".
Writes JSON rows (per-epoch curves, the balance each run got) and a PNG.
--balance (not a default) replaces the automatic partition, which puts all
of cnn but its first convolution on the last stage, where nothing is stale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from jobs.common.choices import PIPELINE_MODES, SEQUENTIAL_MODELS
from jobs.common.inputs import (InputError, JobParser, at_least, comma_list, output_file, parse, positive)
from jobs.common.outputs import write_together
from jobs.common.compute import REAL_CPU, where_and_how, where_and_how_line
from jobs.common.report import run_metadata, save_figure, write_json

TARGET_POINTS = 2.0  # each asynchronous mode's mean within this many points of flush's


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.pipeline_defaults", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", default="mlp,cnn", help="default mlp,cnn")
    p.add_argument("--modes", default=",".join(PIPELINE_MODES), help=f"default {','.join(PIPELINE_MODES)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one run each (default %(default)s)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run (default %(default)s)")
    p.add_argument("--ranks", type=int, default=4, help="one per stage (default 4)")
    p.add_argument("--balance", help="not a default: layers per stage instead of the automatic partition (one "
                                     "model), e.g. 3,3,2,2 to spread cnn's parameters over the stages")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds allowed per training run (default %(default)s)")
    p.add_argument("--baseline", metavar="JSON", help="an earlier run of this benchmark, shown beside (before)")
    p.add_argument("--json", metavar="PATH", help="write the rows and the run's metadata here (default: none)")
    p.add_argument("--plot", metavar="PNG", help="default: the JSON path with .png")
    return parse(p, argv, check_args)


def check_args(args) -> None:
    args.models = comma_list("--models", args.models, allowed=SEQUENTIAL_MODELS)
    for m in args.models:
        if m not in ("mlp", "cnn"):
            raise InputError("--models", f"{m} does not train on Fashion-MNIST in minutes here: mlp or cnn")
    args.modes = comma_list("--modes", args.modes, allowed=PIPELINE_MODES)
    args.seeds = comma_list("--seeds", args.seeds, parse=int, unique=True)
    if min(args.seeds) < 0:
        raise InputError("--seeds", f"must be >= 0, got {min(args.seeds)}")
    at_least(args, 1, "epochs", "ranks")
    if args.balance is not None:
        if len(args.models) != 1:
            raise InputError("--balance", "cuts one model: give one --models")
        parts = comma_list("--balance", args.balance, parse=int)
        if len(parts) != args.ranks or min(parts) < 1:
            raise InputError("--balance", f"needs {args.ranks} positive layer counts (one per rank), got {args.balance}")
    positive(args, "timeout")
    if args.baseline:
        try:
            with open(args.baseline) as f:
                args.baseline_rows = json.load(f)["rows"]
        except (OSError, ValueError, KeyError) as exc:
            raise InputError("--baseline", f"cannot read {args.baseline}: {exc}") from None
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "plot")


def command(args, model: str, mode: str, seed: int, out: str) -> list[str]:
    from mpicomm.launch import mpiexec

    return [mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "jobs.train", "--parallel", "pipeline",
            "--pipeline-mode", mode, "--model", model, "--stages", str(args.ranks), "--epochs", str(args.epochs),
            "--seed", str(seed), "--no-progress", "--json", out] + (["--balance", args.balance] if args.balance else [])


def run(args, model: str, mode: str, seed: int) -> dict:
    """One training job; its row (per-epoch curve, last test accuracy, or stopped=the job's last error line)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "train.json")
        proc = subprocess.run(command(args, model, mode, seed, out), capture_output=True, text=True,
                              timeout=args.timeout)
        row = dict(model=model, mode=mode, seed=seed, epochs=args.epochs, exit=proc.returncode)
        if proc.returncode == 0:
            with open(out) as f:
                saved = json.load(f)
            curve = [dict(epoch=e["epoch"], loss=e["loss"], test_accuracy=e["test_accuracy"]) for e in saved["epochs"]]
            return dict(row, balance=saved["balance"], curve=curve, test_accuracy=curve[-1]["test_accuracy"],
                        stopped=None)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        if proc.returncode != 3 or not errors:  # not the divergence stop: the benchmark itself is broken
            raise RuntimeError(f"{model} {mode} seed {seed} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        return dict(row, balance=None, curve=[], test_accuracy=None, stopped=errors[0])


def mean_of(rows, model: str, mode: str) -> float | None:
    """Mean test accuracy over the seeds; None if a seed's run stopped."""
    accs = [r["test_accuracy"] for r in rows if r["model"] == model and r["mode"] == mode]
    return None if not accs or any(a is None for a in accs) else statistics.fmean(accs)


def table(rows, models, modes, seeds, baseline=None) -> str:
    def pct(a):
        return "stopped" if a is None else f"{a * 100:.2f} %"
    head = ("| model | mode | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | vs flush |"
            + (" before: mean | before: vs flush |" if baseline else "")
            + "\n|---|---|" + "---:|" * (len(seeds) + 2 + (2 if baseline else 0)))
    body = []
    for model in models:
        base, before_base = mean_of(rows, model, "flush"), mean_of(baseline or [], model, "flush")
        for mode in modes:
            accs = [next((r["test_accuracy"] for r in rows if (r["model"], r["mode"], r["seed"]) == (model, mode, s)),
                         None) for s in seeds]
            mean = mean_of(rows, model, mode)
            cells = [pct(a) for a in accs] + [pct(mean), gap(mean, base, mode)]
            if baseline:
                before = mean_of(baseline, model, mode)
                cells += [pct(before), gap(before, before_base, mode)]
            body.append(f"| {model} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join([head, *body])


def gap(mean, base, mode) -> str:
    if mode == "flush":
        return "—"
    if mean is None or base is None:
        return "n/a"
    points = (mean - base) * 100
    return f"{points:+.2f} points" + ("" if abs(points) <= TARGET_POINTS else " ✗")


def plot(rows, models, modes, path, baseline=None, note: str = "job defaults", meta: dict | None = None) -> None:
    """meta: the run's (its machine and compute name the figure); by default this machine's, real compute."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # At least 6.5 inches: the machine line must fit above a single model's plot.
    fig, axes = plt.subplots(1, len(models), figsize=(max(6.5, 4.6 * len(models)), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        for i, mode in enumerate(modes):
            accs = [r["test_accuracy"] * 100 for r in rows if (r["model"], r["mode"]) == (model, mode)
                    and r["test_accuracy"] is not None]
            if accs:
                ax.bar(i, statistics.fmean(accs), color="#4c72b0", label="after" if i == 0 else None)
                ax.scatter([i] * len(accs), accs, color="black", s=12, zorder=3)
            before = mean_of(baseline or [], model, mode)
            if before is not None:
                ax.scatter([i], [before * 100], marker="_", s=500, color="#dd8452", zorder=4,
                           label="before (mean)" if i == 0 else None)
        base = mean_of(rows, model, "flush")
        if base is not None:
            ax.axhspan(base * 100 - TARGET_POINTS, base * 100 + TARGET_POINTS, color="green", alpha=0.12,
                       label=f"flush ± {TARGET_POINTS:g} points")
        ax.set_xticks(range(len(modes)), modes)
        ax.set_ylim(0, 100)
        ax.set_ylabel("test accuracy % (last epoch)")
        ax.set_title(f"{model}, Fashion-MNIST, {note} (dots: seeds)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(where_and_how_line(meta or where_and_how(REAL_CPU)), fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    baseline = getattr(args, "baseline_rows", None)
    rows = []
    try:
        for model in args.models:
            for mode in args.modes:
                for seed in args.seeds:
                    print(f"# {model} {mode} seed {seed} ...", flush=True)
                    rows.append(run(args, model, mode, seed))
                    r = rows[-1]
                    print(f"  {r['stopped']}" if r["stopped"] else
                          "  test accuracy " + ", ".join(f"{e['test_accuracy'] * 100:.2f} %" for e in r["curve"])
                          + f"  (balance {r['balance']})", flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meta = run_metadata("jobs.bench.pipeline_defaults", argv, **where_and_how(REAL_CPU),  # jobs.train on the CPU
                        example=" ".join(command(args, "MODEL", "MODE", 0, "PATH")[1:]))
    print(f"\n{where_and_how_line(meta)}\n" + table(rows, args.models, args.modes, args.seeds, baseline))
    if args.json:
        write_together(None, "--json", args.json, lambda: write_json(args.json, meta, rows))
    if args.plot:
        write_together(None, "--plot", args.plot,
                       lambda: (plot(rows, args.models, args.modes, args.plot, baseline,
                                     f"balance {args.balance}" if args.balance else "job defaults", meta),
                                print(f"wrote {args.plot}")))
    return 0


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
