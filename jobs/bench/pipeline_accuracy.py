"""Benchmark: SpecTrain's accuracy table: data parallel against asynchronous pipelines (vanilla, stash, spectrain).

    mpiexec -n 4 mpitrain bench pipeline-accuracy --json results/acc.json --markdown results/acc.md
    mpiexec -n 4 mpitrain bench pipeline-accuracy --tasks fc --methods dp,spectrain --seeds 1 --epochs 2

Tasks (jobs.bench.pipeline_accuracy_tasks): a CNN (`mpitrain train --model cnn`'s) and an MLP on
a Fashion-MNIST subset, a character-level LSTM on Jane Austen's novels. Methods, all with the same
momentum SGD and learning-rate schedule (warm-up, then a linear decay to 0),
per-update batch and number of updates, on the same data order (a
permutation per seed and epoch) from the same initial weights: dp, gradients averaged
over 4 ranks (a global batch of --batch-size, a quarter per rank); vanilla,
stash (PipeDream's weight stashing) and spectrain (weight prediction), the
model cut into 4 stages, one update per micro-batch of --batch-size,
--microbatches per pipeline step. --lr is the rate of a step of --microbatches
updates, as in `mpitrain train`: every update, dp's too, applies lr / --microbatches
(runtime.pipeline's rule for the asynchronous modes).

What it shares with `mpitrain train`'s defaults: that rule, momentum 0.9, 4 micro-batches per
step. What it keeps of its own, SpecTrain's protocol: dp as the baseline making the very same
updates (not flush), a learning rate tuned for dp per task with warm-up and linear decay, 32
samples per update, a subset and 5-6 epochs (the 13-minute table on 2 cores). The job's
own defaults are measured by `mpitrain bench pipeline-defaults`.

Per run: per epoch the mean training loss
of its updates and the validation loss and accuracy; then the minimum
training loss, minimum validation loss and maximum validation accuracy.
Prints a markdown table of their means over the seeds (± std) and each
method's accuracy gap to dp; writes JSON (rows with per-seed curves), the
table (--markdown) and a PNG of the validation accuracy per epoch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from jobs.bench.pipeline_accuracy_tasks import SEQ_LEN, STAGES, TASKS, load_data, task_data, text_windows
from jobs.common.inputs import (InputError, JobParser, at_least, between, comma_list, launched_ranks, output_file,
                                parse, positive_finite)
from jobs.common.compute import REAL_CPU, where_and_how, where_and_how_line
from jobs.common.outputs import write_results, write_together
from jobs.common.report import run_metadata, save_figure

METHODS = ("dp", "vanilla", "stash", "spectrain")
METRICS = (("min_train_loss", "min train loss"), ("min_val_loss", "min val loss"), ("max_val_acc", "max val acc"))


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.pipeline_accuracy", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--tasks", default=",".join(TASKS), help=f"default {','.join(TASKS)}")
    p.add_argument("--methods", default=",".join(METHODS), help=f"default {','.join(METHODS)}")
    p.add_argument("--seeds", type=int, default=3, help="runs per task and method, seeds 0.. (default 3)")
    # The defaults quoted from the tasks themselves: written by hand, they said 3 epochs where the tasks ran 5.
    each = ", ".join(f"{t} {{}}" for t in TASKS)
    p.add_argument("--epochs", type=int, help="every task (default: each task's, "
                                              f"{each.format(*(TASKS[t].epochs for t in TASKS))})")
    p.add_argument("--batch-size", type=int, default=32, help="samples per update, every method (default 32)")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline: updates per step (default 4)")
    p.add_argument("--lr", type=float, help="peak learning rate of a step, every task; each update applies "
                                            "lr / --microbatches (default: each task's, "
                                            f"{each.format(*(f'{TASKS[t].lr:g}' for t in TASKS))})")
    p.add_argument("--warmup", type=float, default=0.1,
                   help="fraction of the run over which the learning rate rises linearly to --lr (default 0.1)")
    p.add_argument("--lr-schedule", choices=("linear", "constant"), default="linear",
                   help="after the warm-up, linear: down to 0 at the end of the run (default linear)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum, every method (default %(default)s)")
    p.add_argument("--train-samples", type=int, default=8000, help="Fashion-MNIST training images (default 8000)")
    p.add_argument("--val-samples", type=int, default=5000, help="Fashion-MNIST test images scored (default 5000)")
    p.add_argument("--text-chars", type=int, default=200000,
                   help="characters of Austen, the last 10 %% for validation (default 200000)")
    p.add_argument("--json", metavar="PATH", help="write the rows and the run's metadata here (default: none)")
    p.add_argument("--markdown", metavar="PATH", help="write the table and the settings here (default: none)")
    p.add_argument("--plot", metavar="PNG", help="default: the JSON path with .png")
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    args.tasks = comma_list("--tasks", args.tasks, allowed=TASKS)
    args.methods = comma_list("--methods", args.methods, allowed=METHODS)
    at_least(args, 1, "seeds", "epochs", "batch_size", "microbatches")
    at_least(args, 0, "momentum")
    positive_finite(args, "lr")  # inf trained to NaN
    between(args, 0, 1, "warmup")
    if args.batch_size % STAGES:
        raise InputError("--batch-size", f"data parallel splits it over {STAGES} ranks: {args.batch_size} does not")
    if "spectrain" in args.methods and not args.momentum > 0:
        raise InputError("--momentum", "spectrain predicts weights from the momentum: give momentum > 0")
    step = args.batch_size * args.microbatches  # samples of one pipeline step: the fewest an epoch can have
    between(args, step, 60000, "train_samples")
    between(args, 1, 10000, "val_samples")
    train, val = text_windows(args.text_chars)
    if "lstm" in args.tasks and (train < step or val < 1):
        raise InputError("--text-chars", f"{args.text_chars} characters make {train} training and {val} validation "
                                         f"windows of {SEQ_LEN}: need {step} (one pipeline step) and 1")
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "markdown", "plot")
    if launched_ranks() != STAGES:
        raise InputError("", f"needs {STAGES} ranks, one per pipeline stage (mpiexec -n {STAGES}); "
                             f"launched {launched_ranks()}")


class DataParallel:
    """dp: the whole model on every rank, gradients averaged (allreduce); a rank takes 1/P of each batch."""

    def __init__(self, model, make_optimizer, loss, topo, microbatches: int):
        from runtime import DistributedOptimizer

        self.model, self.loss, self.comm = model, loss, topo.world
        self.divisor = microbatches  # each update applies lr / microbatches, as the pipelines' do
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.dopt = DistributedOptimizer(make_optimizer(model.parameters()), model, "allreduce", topology=topo)
        self.loss_ranks = self.size  # each rank's loss is the mean over its share

    def step(self, x, y, updates: int) -> float:
        total = 0.0
        for xb, yb in zip(x.chunk(updates), y.chunk(updates)):
            share = slice(self.rank * len(xb) // self.size, (self.rank + 1) * len(xb) // self.size)
            self.dopt.zero_grad()
            loss = self.loss(self.model(xb[share]), yb[share])
            loss.backward()
            self.dopt.step()
            total += loss.item()
        return total

    def evaluate(self, x, y, batch: int) -> dict:
        """Each rank scores 1/P of the set: what Pipeline.evaluate reports (loss per sample, argmax accuracy)."""
        import numpy as np
        import torch
        from mpi4py import MPI

        self.dopt.synchronize()
        idx = np.array_split(np.arange(len(x)), self.size)[self.rank]
        sums = np.zeros(3)  # loss x samples, correct, targets
        self.model.eval()
        with torch.no_grad():
            for a in range(0, len(idx), batch):
                sl = torch.as_tensor(idx[a:a + batch])
                out = self.model(x[sl])
                sums += [float(self.loss(out, y[sl])) * len(sl), int((out.argmax(-1) == y[sl]).sum()), y[sl].numel()]
        self.model.train()
        self.comm.Allreduce(MPI.IN_PLACE, sums)
        return dict(loss=sums[0] / len(x), accuracy=sums[1] / sums[2])

    def close(self) -> None:
        self.dopt.close()


class Pipelined:
    """vanilla / stash / spectrain: runtime.pipeline, one update per micro-batch, never drained between steps."""

    def __init__(self, model, make_optimizer, loss, topo, balance, microbatches: int, mode: str):
        from runtime.pipeline import Pipeline

        self.pipe = Pipeline(model, make_optimizer, loss_fn=loss, balance=list(balance), microbatches=microbatches,
                             mode=mode, topology=topo, say=None)
        self.loss_ranks = 1  # the last stage alone has the loss
        self.divisor = 1  # the engine applies lr / microbatches per micro-batch itself

    def step(self, x, y, updates: int) -> float:
        loss = self.pipe.train_step(x if self.pipe.first else None, y if self.pipe.last else None)
        return loss * updates if loss is not None else 0.0

    def evaluate(self, x, y, batch: int) -> dict:
        return self.pipe.evaluate(x if self.pipe.first else None, y if self.pipe.last else None, batch)

    def close(self) -> None:
        self.pipe.close()


def lr_factor(args, step: int, steps: int) -> float:
    """Learning rate at pipeline step `step` (0-based, of `steps`) as a fraction of the peak: warm-up, then schedule."""
    factor = min(1.0, (step + 1) / max(1, round(args.warmup * steps)))
    return factor * (1.0 - step / steps) if args.lr_schedule == "linear" else factor


def run(args, task, method, seed, data, topo, say) -> list[dict]:
    """One training run; its per-epoch curve [{epoch, train_loss, val_loss, val_acc, seconds}]."""
    import numpy as np
    import torch
    from mpi4py import MPI

    from runtime.workloads.models import loss_fn

    x, y, vx, vy = data
    lr, epochs = args.lr or TASKS[task].lr, args.epochs or TASKS[task].epochs
    torch.manual_seed(seed)  # the same initial weights for every method
    model = TASKS[task].build()

    optimizers = []  # this rank's (a pipeline stage without parameters makes none)

    def make_optimizer(params):
        optimizers.append(torch.optim.SGD(params, lr=lr, momentum=args.momentum))
        return optimizers[-1]
    loss = loss_fn(TASKS[task].model)
    M, b = args.microbatches, args.batch_size
    trainer = DataParallel(model, make_optimizer, loss, topo, M) if method == "dp" else \
        Pipelined(model, make_optimizer, loss, topo, TASKS[task].balance, M, method)
    steps = len(x) // (M * b)  # each of M updates on b samples: the same updates for every method
    curve = []
    for epoch in range(epochs):
        t0 = time.perf_counter()
        order = torch.as_tensor(np.random.default_rng([seed, epoch]).permutation(len(x)))
        total = 0.0
        for k, idx in enumerate(order[:steps * M * b].split(M * b)):
            for group in (g for opt in optimizers for g in opt.param_groups):
                group["lr"] = lr * lr_factor(args, epoch * steps + k, epochs * steps) / trainer.divisor
            total += trainer.step(x[idx], y[idx], M)
        scores = trainer.evaluate(vx, vy, 500)
        sums = np.array([total])
        topo.world.Allreduce(MPI.IN_PLACE, sums)
        curve.append(dict(epoch=epoch + 1, train_loss=float(sums[0]) / trainer.loss_ranks / (steps * M),
                          val_loss=float(scores["loss"]), val_acc=float(scores["accuracy"]),
                          seconds=time.perf_counter() - t0))
        say(f"  {task} {method} seed {seed} epoch {epoch + 1}: train loss {curve[-1]['train_loss']:.4f}  "
            f"val loss {curve[-1]['val_loss']:.4f}  val acc {curve[-1]['val_acc'] * 100:.2f} %  "
            f"({curve[-1]['seconds']:.1f} s)", flush=True)
    trainer.close()
    return curve


def summarize(runs, tasks, methods) -> list[dict]:
    """One row per task x method: each metric's mean and std over the seeds, the accuracy gap to dp, the runs."""
    rows = []
    for task in tasks:
        for method in methods:
            mine = [r for r in runs if r["task"] == task and r["method"] == method]
            row = dict(task=task, method=method, seeds=len(mine))
            for key, _ in METRICS:
                values = [r[key] for r in mine]
                row[key] = statistics.fmean(values)
                row[key + "_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
            rows.append(dict(row, runs=mine))
        base = next((r for r in rows if r["task"] == task and r["method"] == "dp"), None)
        for r in rows:
            if r["task"] == task:
                r["delta_acc_vs_dp_points"] = None if base is None else (r["max_val_acc"] - base["max_val_acc"]) * 100
    return rows


def table(rows) -> str:
    head = ("| task | method | " + " | ".join(name for _, name in METRICS) + " | Δ acc vs dp |\n"
            "|---|---|" + "---:|" * (len(METRICS) + 1))
    body = []
    for r in rows:
        cells = [f"{r[k]:.4f} ± {r[k + '_std']:.4f}" for k, _ in METRICS[:2]]
        cells.append(f"{r['max_val_acc'] * 100:.2f} ± {r['max_val_acc_std'] * 100:.2f} %")
        delta = r["delta_acc_vs_dp_points"]
        cells.append("—" if delta is None or r["method"] == "dp" else f"{delta:+.2f} points")
        body.append(f"| {r['task']} | {r['method']} | " + " | ".join(cells) + " |")
    return "\n".join([head, *body])


def task_settings(args, task: str) -> dict:
    t = TASKS[task]
    return dict(title=t.title, balance=list(t.balance), lr=args.lr or t.lr, epochs=args.epochs or t.epochs)


def markdown(args, rows, seconds: float, meta: dict) -> str:
    tasks = "\n".join(f"- {t}: {s['title']}; stages of {s['balance']} layers; lr {s['lr']:g} per step "
                      f"({s['lr'] / args.microbatches:g} per update), {s['epochs']} epochs"
                      for t, s in ((t, task_settings(args, t)) for t in args.tasks))
    return (f"# Pipeline accuracy (SpecTrain's table)\n\n"
            f"4 ranks: dp = data parallel (allreduce), vanilla / stash / spectrain = a 4-stage pipeline. "
            f"{args.batch_size} samples per update, {args.microbatches} updates per pipeline step, the same updates "
            f"for every method; momentum SGD (momentum {args.momentum:g}), the learning rate warmed up over "
            f"{args.warmup:g} of the run, then {args.lr_schedule}. Mean ± std over {args.seeds} seed(s).\n\n"
            f"{tasks}\n\n{where_and_how_line(meta)}\n\n{table(rows)}\n\nRun time: {seconds:.0f} s.\n")


def plot(rows, tasks, methods, path, meta: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for r in (r for r in rows if r["task"] == task):
            curves = [[e["val_acc"] * 100 for e in run["epochs"]] for run in r["runs"]]
            ax.plot(range(1, len(curves[0]) + 1), [statistics.fmean(c) for c in zip(*curves)], marker="o",
                    label=r["method"], linestyle="--" if r["method"] == "dp" else "-")
        ax.set_title(TASKS[task].title, fontsize=9)
        ax.set_xlabel("epoch")
        ax.set_ylabel("validation accuracy %")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Pipeline accuracy: validation accuracy per epoch, mean over {meta['settings']['seeds']} seed(s), "
                 f"{meta['ranks']} ranks\n{where_and_how_line(meta)}", fontsize=8)
    save_figure(fig, path)


def main(argv=None, args=None) -> int:
    args = args or parse_args(argv)
    import torch

    from mpicomm import Topology

    torch.set_num_threads(1)
    topo = Topology()
    comm, rank = topo.world, topo.rank
    say = print if rank == 0 else (lambda *a, **k: None)
    data, problem = None, None
    if rank == 0:  # one reader; the others get the tensors
        try:
            data = load_data(args.tasks, args.train_samples, args.val_samples, args.text_chars)
        except (OSError, ValueError, RuntimeError) as exc:  # a missing data set, a corpus that cannot be fetched
            problem = f"{type(exc).__name__}: {exc}"
    data, problem = comm.bcast((data, problem), root=0)
    if problem is not None:
        say(f"error: {problem}", file=sys.stderr, flush=True)
        topo.free()
        return 2
    start, runs = time.perf_counter(), []
    for task in args.tasks:
        for method in args.methods:
            for seed in range(args.seeds):
                say(f"# {task}, {method}, seed {seed} ...", flush=True)
                curve = run(args, task, method, seed, task_data(data, task), topo, say)
                runs.append(dict(task=task, method=method, seed=seed, epochs=curve,
                                 min_train_loss=min(e["train_loss"] for e in curve),
                                 min_val_loss=min(e["val_loss"] for e in curve),
                                 max_val_acc=max(e["val_acc"] for e in curve),
                                 seconds=sum(e["seconds"] for e in curve)))
    seconds = time.perf_counter() - start
    rows = summarize(runs, args.tasks, args.methods)
    meta = run_metadata("jobs.bench.pipeline_accuracy", argv, ranks=comm.Get_size(), seconds=seconds,
                        **where_and_how(REAL_CPU),
                        settings={k: v for k, v in vars(args).items() if k not in ("json", "markdown", "plot")},
                        tasks={t: task_settings(args, t) for t in args.tasks})
    say(f"\n{where_and_how_line(meta)}\n" + table(rows) + f"\n\n{len(runs)} runs in {seconds:.0f} s", flush=True)
    write_results(comm, args, meta, rows, lambda path: plot(rows, args.tasks, args.methods, path, meta), say=say)
    if args.markdown:
        def write_markdown():
            os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
            with open(args.markdown, "w") as f:
                f.write(markdown(args, rows, seconds, meta))
            say(f"wrote {args.markdown}")
        write_together(comm, "--markdown", args.markdown, write_markdown, here=rank == 0)
    topo.free()
    return 0


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before torch and MPI start
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
