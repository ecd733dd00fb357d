"""Benchmark: pipeline modes vs data parallelism vs torch's Schedule1F1B, samples/s, bytes and memory across bandwidths.

    mpitrain bench pipeline --json results/pipeline.json                 # as root: emulated cluster
    mpitrain bench pipeline --models fc-heavy --bandwidths 1gbit --rounds 3 --iters 5
    mpitrain bench pipeline --local --models mlp --rounds 1             # no root: this host, unshaped
    mpitrain bench pipeline --local --device cuda --models fc-heavy,vgg19  # ranks on GPUs (may share one)
    mpitrain bench pipeline --local --models char-lstm --compute emulated:v100  # each rank a modelled V100

For every bandwidth an emulated cluster of --hosts hosts (one rank each: one pipeline
stage per host) is brought up and jobs.bench.pipeline_worker runs every model across
it: the pipeline modes flush, vanilla, stash, spectrain (runtime.pipeline), the
data-parallel strategies allreduce, wfbp, p3 and torch DDP, and torch-1f1b
(torch.distributed.pipelining over gloo, the same balance and micro-batches), all on the
same global batch per step, interleaved over --rounds rounds. Prints a markdown table
per model as it finishes, then a summary per model and bandwidth against issue 11's
targets (set for fc-heavy at 1 Gbit/s): best asynchronous pipeline >= 1.5 x best data
parallel samples/s; flush >= 1.0 x torch-1f1b; data-parallel bytes per step >= 10 x the
pipeline's (the SpecTrain paper reports 13.4 x on average). The two rate targets are judged
on the ratio round by round (the rounds interleave the contenders): its median and
distribution-free interval (jobs.common.stats.median_ci), met when the interval clears the
target, not met when it lies below, undecided when it straddles it or there is one round.
Writes JSON rows (see jobs.bench.pipeline_worker for the columns; the summary, the machine
and, after a failed run, incomplete and failed_runs are in the JSON's meta; a failed run
exits 1 with the rows measured written) and a PNG of samples/s per contender and bandwidth,
one panel per model, its title naming the compute and the machine.

Bytes per step per rank are the interface's tx_bytes on the emulated cluster (wire bytes,
TCP/IP headers and the ACKs of received data included); with --local, where every rank
shares one loopback, the pipeline engine's own count and, for data parallelism, the ring
allreduce's 2(P-1)/P x gradient bytes ("computed"). Memory: weight_copy_bytes (weight
versions a mode keeps beyond the live weights: stash's stashed versions, spectrain's
predicted ones), RSS after the timed steps, and VmHWM, the process's peak so far, which
only grows across the contenders of one process.

--compute emulated:DEVICE (or emulated:PROFILE.json, --compute-scale): every contender under the same
compute model (runtime.emulate): each pipeline stage, each torch-1f1b stage and data parallelism's model
wait a modelled GPU's time instead of computing, the balance comes from the modelled layer times, and a
rank's CPU is free while it "computes", so several ranks on few cores measure communication as GPU hosts
would. The tables' title, every JSON row (compute, compute_device, compute_scale, emulated_parts,
real_parts), the meta and the plot name the compute.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import textwrap

from jobs.bench import pipeline_worker as worker
from jobs.common.cluster_sweep import exit_status, incomplete_meta, incomplete_note, sweep
from jobs.common.compute import Compute, add_compute_arguments
from jobs.common.inputs import (JobParser, add_cluster_bench_arguments, add_device_argument, at_least,
                                cluster_bench_outputs, comma_list, parse)
from jobs.common.outputs import write_together
from jobs.common.report import machine, machine_line, run_metadata, save_figure, write_json
from jobs.common.stats import coverage_text, median_ci

DEFAULT_BANDWIDTHS = "1gbit,10gbit,none"
ASYNC, DP = worker.ASYNC_MODES, worker.DATA_PARALLEL
TARGETS = dict(async_over_dp=1.5, flush_over_torch=1.0, dp_over_pipeline_bytes=10.0)
TARGET_CASE = ("fc-heavy", "1gbit")  # where issue 11 sets them


def parse_args(argv=None):
    """The checked command line: everything the worker would refuse is refused here, before a cluster is up."""
    p = JobParser(prog="python -m jobs.bench.pipeline", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", default="fc-heavy,vgg19,char-lstm")
    p.add_argument("--contenders", help=f"default {','.join(worker.CONTENDERS)} (without torch-1f1b with --device "
                                        "cuda)")
    add_device_argument(p)
    p.add_argument("--hosts", type=int, default=4, help="one rank, one pipeline stage each (default 4)")
    p.add_argument("--batch-size", type=int, default=64, help="global samples per step, every contender (default 64)")
    p.add_argument("--microbatches", type=int, default=8, help="per step, pipelines and torch-1f1b (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the contenders (default 3)")
    p.add_argument("--iters", type=int, default=5, help="timed steps per contender per round (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender per round (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", help=argparse.SUPPRESS)  # the mlp's widths, e.g. 64,64,64 (tests)
    add_cluster_bench_arguments(p, DEFAULT_BANDWIDTHS)
    add_compute_arguments(p)
    return parse(p, argv, check_args)


def check_args(args) -> None:
    args.models = comma_list("--models", args.models)
    worker.check_models("--models", args.models)
    at_least(args, 1, "hosts")
    worker.check_settings(args, args.models, args.hosts)
    cluster_bench_outputs(args, DEFAULT_BANDWIDTHS)


def worker_cmd(args, model, label):
    cmd = [sys.executable, "-m", "jobs.bench.pipeline_worker", "--model", model,
           "--contenders", ",".join(args.contenders), "--batch-size", str(args.batch_size),
           "--microbatches", str(args.microbatches), "--rounds", str(args.rounds), "--iters", str(args.iters),
           "--warmup", str(args.warmup), "--bandwidth", label, "--seed", str(args.seed), "--device", args.device,
           "--compute", args.compute, "--compute-scale", repr(args.compute_scale)]
    return cmd + (["--hidden", ",".join(map(str, args.hidden))] if args.hidden else [])


def mb(value, digits=2) -> str:
    return "-" if value is None else f"{value / 1e6:.{digits}f}"


def markdown(rows) -> str:
    head = ("| model | contender | bandwidth | samples/s | ± CI | T_iter s | rounds×steps | MB/step/rank mean "
            "| max | measured by | weight copies MB | RSS MB | HWM MB | balance |\n"
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
    body = [f"| {r['model']} | {r['contender']} | {r['bandwidth']} | {r['samples_per_s']:.1f} | {r['ci']:.1f} | "
            f"{r['t_iter_s']:.3f} | {r['rounds']}×{r['steps'] // r['rounds']} | {mb(r['bytes_per_step'], 3)} | "
            f"{mb(r['bytes_per_step_max'], 3)} | {r['bytes_measured']} | {mb(r['weight_copy_bytes'], 1)} | "
            f"{r['rss_mb']:.0f} | {r['hwm_mb']:.0f} | {','.join(map(str, r['balance'] or [])) or '-'} |"
            for r in rows]
    return "\n".join([head, *body])


def reading(rows) -> str:
    """How to read the table's rate and CI (printed once, above the final table)."""
    how = ", ".join(coverage_text(n) for n in sorted({r["rounds"] for r in rows}))
    return (f"samples/s: the batch over the median round's T_iter (a round's T_iter: the mean of its steps, the "
            f"slowest rank's); ± CI: {how} of that median, across rounds")


def paired(row: dict, other: dict) -> dict:
    """row's samples/s over other's, round by round (the same batch: the inverse ratio of T_iter; the rounds
    interleave the contenders, so a slow spell falls on both): the median ratio and its median_ci."""
    ratios = [b / a for a, b in zip(row["t_iter_rounds_s"], other["t_iter_rounds_s"]) if a > 0]
    low, high, coverage = median_ci(ratios)
    return dict(median=statistics.median(ratios), ci=[low, high], coverage=coverage, rounds=len(ratios))


def judged(p: dict, target: float) -> str:
    """met when the ratio's interval clears the target, not met below it, undecided when it straddles it (or one
    round gave no interval)."""
    if p["coverage"] == 0 or p["ci"][0] < target <= p["ci"][1]:
        return "undecided"
    return "met" if p["ci"][0] >= target else "not met"


def summarize(rows) -> list[dict]:
    """Per (model, bandwidth): the three ratios of issue 11's targets, and whether each is met (judged)."""
    out = []
    for model, bw in dict.fromkeys((r["model"], r["bandwidth"]) for r in rows):
        by = {r["contender"]: r for r in rows if (r["model"], r["bandwidth"]) == (model, bw)}

        def best(names, key="samples_per_s", pick=max):
            mine = [by[n] for n in names if n in by and by[n][key] is not None]
            return pick(mine, key=lambda r: r[key]) if mine else None

        def rate_ratio(a, b):  # paired round by round (None without both)
            return paired(a, b) if a is not None and b is not None else None

        pipeline_bytes = best(worker.PIPELINE_MODES, "bytes_per_step")  # the most any pipeline mode sent
        dp_bytes = best(DP, "bytes_per_step", min)
        s = dict(model=model, bandwidth=bw, target_case=(model, bw) == TARGET_CASE,
                 async_over_dp_paired=rate_ratio(best(ASYNC), best(DP)),
                 flush_over_torch_paired=rate_ratio(by.get("flush"), by.get("torch-1f1b")),
                 dp_over_pipeline_bytes=(dp_bytes["bytes_per_step"] / pipeline_bytes["bytes_per_step"]
                                         if dp_bytes and pipeline_bytes and pipeline_bytes["bytes_per_step"] else None),
                 stash_weight_copy_bytes=by.get("stash", {}).get("weight_copy_bytes"),
                 spectrain_weight_copy_bytes=by.get("spectrain", {}).get("weight_copy_bytes"))
        for key in ("async_over_dp", "flush_over_torch"):
            s[key] = None if s[f"{key}_paired"] is None else s[f"{key}_paired"]["median"]
        s["met"] = {k: judged(s[f"{k}_paired"], TARGETS[k]) for k in ("async_over_dp", "flush_over_torch")
                    if s[f"{k}_paired"] is not None}
        if s["dp_over_pipeline_bytes"] is not None:  # counted bytes: no rounds to pair
            s["met"]["dp_over_pipeline_bytes"] = "met" if s["dp_over_pipeline_bytes"] >= TARGETS[
                "dp_over_pipeline_bytes"] else "not met"
        out.append(s)
    return out


MARK = {"met": "✓", "not met": "✗", "undecided": "undecided"}


def summary_markdown(summary) -> str:
    def cell(s, key):
        if s[key] is None:
            return "-"
        p = s.get(f"{key}_paired")
        ci = "" if p is None else f" ({p['ci'][0]:.2f}-{p['ci'][1]:.2f})"
        return f"{s[key]:.2f}×{ci} {MARK[s['met'][key]]}"
    rounds = sorted({p["rounds"] for s in summary for k in ("async_over_dp", "flush_over_torch")
                     if (p := s.get(f"{k}_paired")) is not None})
    how = ("samples/s ratios: the median of the ratios round by round, (low-high) "
           + ", ".join(coverage_text(n) for n in rounds) + "; ✓ the interval clears the target, ✗ it lies below, "
           "undecided: it straddles the target (or one round)\n") if rounds else ""
    head = ("| model | bandwidth | best async / best DP samples/s (≥ 1.5) | flush / torch-1f1b (≥ 1.0) "
            "| DP / pipeline bytes per step (≥ 10) | weight copies MB stash / spectrain |\n"
            "|---|---|---:|---:|---:|---:|")
    body = [f"| {s['model']}{' (target)' if s['target_case'] else ''} | {s['bandwidth']} | "
            f"{cell(s, 'async_over_dp')} | {cell(s, 'flush_over_torch')} | {cell(s, 'dp_over_pipeline_bytes')} | "
            f"{mb(s['stash_weight_copy_bytes'], 1)} / {mb(s['spectrain_weight_copy_bytes'], 1)} |" for s in summary]
    return how + "\n".join([head, *body])


def plot(rows, path, title: str = ""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    width = 0.8 / len(contenders)
    for ax, model in zip(axes[0], models):
        labels = list(dict.fromkeys(r["bandwidth"] for r in rows if r["model"] == model))
        for j, c in enumerate(contenders):
            pts = {r["bandwidth"]: r for r in rows if r["model"] == model and r["contender"] == c}
            xs = [i for i, b in enumerate(labels) if b in pts]
            rates = [pts[labels[i]]["samples_per_s"] for i in xs]
            cis = [pts[labels[i]]["samples_per_s_ci"] for i in xs]
            ax.bar([x - 0.4 + (j + 0.5) * width for x in xs], rates, width, capsize=2, label=c,
                   yerr=[[v - lo for v, (lo, _) in zip(rates, cis)], [hi - v for v, (_, hi) in zip(rates, cis)]],
                   hatch="//" if worker.kind(c) == "data-parallel" else ".." if worker.kind(c) == "peer" else None)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(model)
        ax.set_xlabel("link bandwidth per host")
        ax.set_ylabel("samples/s (median of rounds, CI)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    if title:  # wrapped to the figure's width, line by line: the compute's label is long
        width = int(fig.get_figwidth() * 14)
        fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()
    print(f"# load average before: {load[0]:.2f} (other work on this machine skews the figures)", flush=True)
    compute = Compute.from_args(args).label
    print(f"# {compute}", flush=True)
    rows, failed = sweep(args, lambda model, label, _ranks: worker_cmd(args, model, label), markdown)
    if not rows:  # a run failed before any row came (bad input was refused before the sweep: not 2)
        return 1
    summary = summarize(rows)
    # What the figures were measured on, and under which compute: the table's and the figure's title.
    heading = "\n".join(filter(None, [incomplete_note(failed), compute, machine_line(machine())]))
    print(f"\n{heading}\n{reading(rows)}\n" + markdown(rows) + "\n\n" + summary_markdown(summary))
    if args.json:
        meta = run_metadata("jobs.bench.pipeline", argv, machine=machine(), load_average_before=load, summary=summary,
                            targets=dict(TARGETS, case=TARGET_CASE), compute_label=compute,
                            **{k: rows[0][k] for k in ("compute", "compute_device", "compute_scale")},
                            **incomplete_meta(failed))
        write_together(None, "--json", args.json, lambda: write_json(args.json, meta, rows))
    if args.plot and rows:
        write_together(None, "--plot", args.plot,
                       lambda: (plot(rows, args.plot, heading), print(f"wrote {args.plot}")))
    return exit_status(failed)


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
