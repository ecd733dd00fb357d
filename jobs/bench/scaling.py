r"""Benchmark: the scaling curve, each strategy's samples/s on 1, 2, 4, 8 ... ranks over emulated links.

    mpitrain bench scaling --models vgg19-22k --strategies wfbp,p3,hybcomm,ddp --ranks 1,2,4,8 \
        --ranks-per-host 1 --bandwidth 10gbit --batch-size 8 --json results/scaling.json   # as root
    mpitrain bench scaling --local --models mlp --strategies allreduce,wfbp --ranks 1,2  # no root
    mpitrain bench scaling --models vgg19-224 --strategies wfbp,ddp --compute emulated:v100   # modelled V100s

For every bandwidth and rank count n, an emulated cluster of ceil(n / --ranks-per-host)
hosts runs jobs.bench.strategies_worker with every strategy (one rank alone runs on this host,
with no cluster; --local runs every count here, unshaped), its --rounds rounds interleaving the
strategies. --passes P (default 3) repeats that over every rank count, each pass in the reverse
order of the one before (1,2,4,8, then 8,4,2,1, ...: ABBA), so that a slow spell of the machine
falls on every count alike. The speed-up over the same strategy on the fewest ranks n0 (normally 1)
is taken within each pass, then its median over the passes with a distribution-free interval
(jobs.common.stats.median_ci; the title says its coverage: 95 % needs >= 6 passes); the scaling
efficiency is speed-up x n0 / n. samples/s is the median over the passes (with one pass, the
worker's median over its rounds) with its interval. Prints a table, the machine and the compute in
its title; writes the worker's JSON rows with pass_samples_per_s, pass_speedups, speedup(_ci) and
efficiency(_ci) added (meta: the machine, the passes; incomplete and failed_runs when a run failed:
the rows measured are kept, the exit status is then 1), and a PNG of samples/s against ranks, one
line per strategy, linear scaling dashed.

--compute emulated:DEVICE (or emulated:PROFILE.json, --compute-scale): every rank's model, loss and
optimizer wait a modelled GPU's time instead of computing (runtime.emulate, in the strategies worker), so
the ranks' CPUs stay free for the communication as a GPU host's do. The table's title, the JSON (rows:
compute, compute_device, compute_scale, emulated_parts, real_parts; the meta) and the plot name the compute.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import textwrap

from jobs.bench import strategies as bench
from jobs.common.cluster_sweep import exit_status, incomplete_meta, incomplete_note, sweep
from jobs.common.compute import Compute, add_compute_arguments, check_compute
from jobs.common.inputs import (InputError, JobParser, add_cluster_bench_arguments, between, cluster_bench_outputs,
                                int_list, parse)
from jobs.common.outputs import write_results
from jobs.common.report import machine, machine_line, run_metadata, save_figure
from jobs.common.stats import coverage_text, median_ci

DEFAULT_BANDWIDTHS = "10gbit"


def parse_args(argv=None):
    """The checked command line: everything the worker would refuse is refused here, before a cluster is up."""
    p = JobParser(prog="python -m jobs.bench.scaling", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    bench.add_worker_arguments(p, "vgg19-22k", "wfbp,p3,hybcomm,ddp", batch_size=8, emulated=True)
    p.add_argument("--ranks", default="1,2,4,8", help="world sizes, increasing (default 1,2,4,8)")
    p.add_argument("--passes", type=int, default=3,
                   help="passes over every rank count, alternating direction (ABBA); speed-ups are taken within "
                        "a pass, their median and interval over the passes (default 3; 95 %% CIs from 6)")
    add_cluster_bench_arguments(p, DEFAULT_BANDWIDTHS)
    add_compute_arguments(p)
    return parse(p, argv, check_args)


def check_args(args) -> None:
    bench.check_worker_arguments(args)
    between(args, 1, 100, "passes")
    args.ranks = check_ranks(args.ranks, args.ranks_per_host)
    args.hosts = None  # the clusters' sizes come from --ranks
    cluster_bench_outputs(args, DEFAULT_BANDWIDTHS)
    check_compute(args)
    if not args.local:
        from mpicomm.emulation.netns import MAX_HOSTS

        if -(-args.ranks[-1] // args.ranks_per_host) > MAX_HOSTS:
            raise InputError("--ranks", f"{args.ranks[-1]} ranks need more than {MAX_HOSTS} hosts of "
                                        f"{args.ranks_per_host}: raise --ranks-per-host")


def check_ranks(text: str, per_host: int) -> list[int]:
    """--ranks: increasing counts >= 1, each 1 or a multiple of per_host (nodes must hold equally many ranks)."""
    ranks = int_list("--ranks", text, 1)
    if any(b <= a for a, b in zip(ranks, ranks[1:])):
        raise InputError("--ranks", f"must increase, got {','.join(map(str, ranks))}")
    uneven = [n for n in ranks if n > 1 and n % per_host]
    if uneven:
        raise InputError("--ranks", f"{uneven[0]} ranks do not fill hosts of --ranks-per-host {per_host}")
    return ranks


def worker_cmd(args, model: str, label: str, ranks: int) -> list[str]:
    """The strategies worker's command for `ranks` ranks, with the compute (unless its driver passed it on)."""
    cmd = bench.worker_cmd(args, model, label, ranks)
    if args.compute != "real" and "--compute" not in cmd:
        cmd += ["--compute", args.compute, "--compute-scale", repr(args.compute_scale)]
    return cmd


def pass_runs(models: list[str], ranks: list[int], passes: int) -> list[tuple[str, int]]:
    """(model, ranks) for every pass, each pass over the rank counts in the reverse order of the one before (ABBA)."""
    return [(model, n) for p in range(passes) for n in (ranks if p % 2 == 0 else ranks[::-1]) for model in models]


def combine(rows: list[dict]) -> list[dict]:
    """One row per model, bandwidth, strategy and ranks from its passes' rows (each tagged "pass"): samples/s the
    median over the passes (one pass: the worker's own, over its rounds), and the speed-up over the fewest ranks
    taken within each pass, its median and median_ci over the passes; efficiency = speed-up x n0 / n."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["bandwidth"], r["strategy"], r["ranks"]), []).append(r)
    out, base = [], {}
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2], k[3])):
        mine = sorted(groups[key], key=lambda r: r["pass"])
        row = {k: v for k, v in mine[-1].items() if k != "pass"}
        row["pass_samples_per_s"] = {r["pass"]: r["samples_per_s"] for r in mine}
        row["passes"] = len(mine)
        if len(mine) > 1:  # the passes' spread, not one pass's rounds: what a slow spell between passes moves
            rates = [r["samples_per_s"] for r in mine]
            low, high, coverage = median_ci(rates)
            rate = statistics.median(rates)
            row.update(samples_per_s=rate, samples_per_s_ci=[low, high], ci=max(high - rate, rate - low),
                       ci_coverage=coverage, samples_per_s_over="passes")
        else:
            row["samples_per_s_over"] = "rounds"
        b = base.setdefault(key[:3], row)  # the fewest ranks come first
        pairs = [(p, v / b["pass_samples_per_s"][p]) for p, v in row["pass_samples_per_s"].items()
                 if b["pass_samples_per_s"].get(p)]
        row["baseline_ranks"] = b["ranks"]
        row["pass_speedups"] = [v for _, v in pairs]
        if pairs:
            low, high, coverage = median_ci(row["pass_speedups"])
            speedup, f = statistics.median(row["pass_speedups"]), b["ranks"] / row["ranks"]
            row.update(speedup=speedup, speedup_ci=[low, high], speedup_coverage=coverage,
                       efficiency=speedup * f, efficiency_ci=[low * f, high * f])
        else:  # no pass measured both counts (a run failed)
            row.update(speedup=None, speedup_ci=None, speedup_coverage=None, efficiency=None, efficiency_ci=None)
        out.append(row)
    for r in out:  # JSON keys are strings: the passes as a list in pass order
        r["pass_samples_per_s"] = [r["pass_samples_per_s"][p] for p in sorted(r["pass_samples_per_s"])]
    return out


def reading(rows) -> str:
    """How to read the table's intervals: what samples/s and the speed-up are medians of, and their coverage."""
    passes = sorted({r["passes"] for r in rows})
    rounds = sorted({r["rounds"] for r in rows})
    over_passes = ", ".join(coverage_text(n).replace("rounds", "passes").replace("round", "pass") for n in passes)
    if passes == [1]:
        rate = "the median over the worker's rounds, ± " + ", ".join(coverage_text(n) for n in rounds)
    else:
        rate = "the median over the passes, ± " + over_passes
    return (f"samples/s: {rate}; speed-up (low-high): the median over the passes of each pass's ratio to the fewest "
            f"ranks, {over_passes}; efficiency = speed-up x n0 / n")


def title(rows, compute_label: str, failed: list[dict]) -> str:
    """The table's and the figure's title: a failed run, the compute, the machine, how to read the intervals."""
    return "\n".join(filter(None, [incomplete_note(failed), compute_label, machine_line(machine()), reading(rows)]))


def markdown(rows) -> str:
    def spread(value, ci, digits=2) -> str:
        if value is None:
            return "-"
        return f"{value:.{digits}f} ({ci[0]:.{digits}f}-{ci[1]:.{digits}f})"
    head = ("| model | bandwidth | strategy | ranks | samples/s | ± CI | speed-up (CI) | efficiency (CI) | passes "
            "| wire MB/step |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    order = sorted(rows, key=lambda r: (r["model"], r["bandwidth"], r["strategy"], r["ranks"]))
    body = [f"| {r['model']} | {r['bandwidth']} | {r['strategy']} | {r['ranks']} | {r['samples_per_s']:.1f} | "
            f"{r['ci']:.1f} | {spread(r['speedup'], r['speedup_ci'])} | {spread(r['efficiency'], r['efficiency_ci'])} "
            f"| {r['passes']} | {bench.mb(r, 'wire_bytes_per_step')} |" for r in order]
    return "\n".join([head, *body])


def plot(rows, path, title: str = ""):
    """One panel per model and bandwidth: samples/s against ranks per strategy, and n / n0 x the best n0 rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["model"], r["bandwidth"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (model, bw) in zip(axes[0], panels):
        mine = [r for r in rows if (r["model"], r["bandwidth"]) == (model, bw)]
        ranks = sorted({r["ranks"] for r in mine})
        for strategy in dict.fromkeys(r["strategy"] for r in mine):
            pts = sorted((r for r in mine if r["strategy"] == strategy), key=lambda r: r["ranks"])
            rates = [r["samples_per_s"] for r in pts]
            ax.errorbar([r["ranks"] for r in pts], rates, marker="o", capsize=3, label=strategy,
                        yerr=[[v - r["samples_per_s_ci"][0] for v, r in zip(rates, pts)],
                              [r["samples_per_s_ci"][1] - v for v, r in zip(rates, pts)]])
        best = max(r["samples_per_s"] for r in mine if r["ranks"] == ranks[0])
        ax.plot(ranks, [n / ranks[0] * best for n in ranks], "k--", linewidth=1, label="linear scaling")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks, [str(n) for n in ranks])
        ax.minorticks_off()
        ax.set_title(f"{model} at {bw}")
        ax.set_xlabel("ranks")
        ax.set_ylabel("samples/s (median, CI)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if title:  # wrapped to the figure's width, line by line: the compute's label is long
        width = int(fig.get_figwidth() * 14)
        fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    compute = Compute.from_args(args)
    print(f"# {compute.label}", flush=True)
    runs = pass_runs(args.models, args.ranks, args.passes)
    count = itertools.count()  # sweep's runs come in order, bandwidth by bandwidth: each one's pass

    def tag(new: list[dict], _label: str) -> None:
        at = next(count) % len(runs)
        for r in new:
            r["pass"] = at // (len(args.ranks) * len(args.models))
    rows, failed = sweep(args, lambda model, label, n: worker_cmd(args, model, label, n), bench.markdown,
                         args.ranks_per_host, runs, adjust=tag)
    if not rows:  # a run failed before any row came (bad input was refused before the sweep: not 2)
        return 1
    rows = combine(rows)
    for r in rows:  # the worker's own fields first (its accelerator knows what it emulated)
        for k, v in compute.describe().items():
            r.setdefault(k, v)
    heading = title(rows, compute.label, failed)
    print(f"\n{heading}\n" + markdown(rows))
    meta = run_metadata("jobs.bench.scaling", argv, machine=machine(), compute_label=compute.label,
                        passes=args.passes, order="ABBA: each pass over the rank counts reverses the one before",
                        ci="order statistics (jobs.common.stats.median_ci) over the passes; one pass: its rounds",
                        **{k: rows[0][k] for k in ("compute", "compute_device", "compute_scale")},
                        **incomplete_meta(failed))
    write_results(None, args, meta, rows, lambda path: plot(rows, path, heading))
    return exit_status(failed)


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
