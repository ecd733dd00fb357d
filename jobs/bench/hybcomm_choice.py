"""Benchmark: does hybcomm's cost model pick the faster path, SFB or PS, for every FC layer, batch size and rank count.

    mpitrain bench hybcomm-choice --bandwidth 1gbit --json results/hybcomm_choice.json   # root: emulated cluster
    mpitrain bench hybcomm-choice --ranks 4,8 --ranks-per-host 2 --layers 0,1 --rounds 5
    mpitrain bench hybcomm-choice --local --model mlp --ranks 2          # no root: this host, unshaped
    mpitrain bench hybcomm-choice --compute emulated:v100 --layers 0,1   # each rank a modelled V100

Issue 12's target: the cost model picks, for every FC layer (default vgg19-22k's classifier:
512×4096, 4096×4096, 4096×21841) at every K in --batch-sizes (rows per rank per step) and P in
--ranks, the path that measures faster when each is forced. For every P an emulated cluster of
P / --ranks-per-host hosts, linked at --bandwidth, is brought up and
jobs.bench.hybcomm_choice_worker runs across it (its docstring gives the protocol: rounds of
forced sfb and ps interleaved, the cost model's pick after one step of force="auto"). With
--local the P ranks run on this host, unshaped, in emulated nodes of --ranks-per-host: the
cost model still prices --bandwidth, so there its picks face links it does not describe
(a run that checks the job, not the target).

Prints a markdown table per P as it finishes, then the whole table, "the cost model picked the
faster path in X of Y cases" and every miss with both measured times, the predicted seconds
(the rebuild's share at the GEMM rate priced at wrap) and the rebuild measured alone: where
the model's rate or its link time is off reads from there. Writes JSON rows (see the worker
for the columns; the summary and the machine in the meta) and a PNG: a panel per layer, seconds per
step against K (log-log), measured sfb and ps per P, the predicted crossover K marked, the compute
and the machine in its title. A run that fails ends the sweep with one error line: the rows measured
are still written (meta: incomplete, failed_runs) and the exit status is 1.

Memory: the 4096×21841 layer holds over 1 GB per rank (weights, gradients, momentum), and every
rank of the emulated cluster runs on this one machine: P=8 wants about 10 GB free (--layers
0,1 leaves it out).

--compute emulated:DEVICE (or emulated:PROFILE.json, --compute-scale): the layer, its loss and optimizer
wait a modelled GPU's time (runtime.emulate) and the cost model prices the rebuild at the device's
modelled GEMM rate, not this host's; rows add rebuild_modelled_s (the device's time for each rebuild).
The table's title, the JSON (rows and meta) and the plot name the compute.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from jobs.bench import hybcomm_choice_worker as worker
from jobs.common.cluster_sweep import exit_status, incomplete_meta, incomplete_note, sweep
from jobs.common.compute import Compute
from jobs.common.inputs import InputError, JobParser, add_run_arguments, at_least, bench_outputs, int_list, parse
from jobs.common.outputs import write_results
from jobs.common.report import machine, machine_line, run_metadata, save_figure

MARKERS = "osD^vPX*"


def parse_args(argv=None):
    """The checked command line: everything the worker would refuse is refused here, before a cluster is up."""
    p = JobParser(prog="python -m jobs.bench.hybcomm_choice", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--ranks", default="2,4,8", help="P, one cluster each (default 2,4,8)")
    p.add_argument("--ranks-per-host", type=int, default=1, help="must divide every P (default 1)")
    worker.add_settings(p)
    add_run_arguments(p)
    return parse(p, argv, check_args)


def check_args(args) -> None:
    args.ranks = int_list("--ranks", args.ranks, 2)  # one rank has nothing to exchange
    at_least(args, 1, "ranks_per_host")
    for P in args.ranks:
        if P % args.ranks_per_host:  # every node must hold as many ranks (mpicomm.Topology)
            raise InputError("--ranks-per-host", f"{args.ranks_per_host} does not divide --ranks {P}")
    bench_outputs(args)
    worker.check_settings(args)
    if not args.local:
        from mpicomm.emulation.netns import MAX_HOSTS

        if max(args.ranks) // args.ranks_per_host > MAX_HOSTS:
            raise InputError("--ranks", f"{max(args.ranks)} ranks at {args.ranks_per_host} per host need "
                                        f"{max(args.ranks) // args.ranks_per_host} hosts; the emulated cluster "
                                        f"has at most {MAX_HOSTS} (raise --ranks-per-host)")
    args.bandwidths = [args.bandwidth]  # jobs.common.cluster_sweep's one bandwidth


def worker_cmd(args, label: str) -> list[str]:
    layers = ",".join(str(i) for i, _ in args.fc)
    cmd = [sys.executable, "-m", "jobs.bench.hybcomm_choice_worker", "--model", args.model, "--layers", layers,
           "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--rounds", str(args.rounds),
           "--iters", str(args.iters), "--warmup", str(args.warmup), "--bandwidth", args.bandwidth,
           "--label", label, "--seed", str(args.seed), "--compute", args.compute,
           "--compute-scale", repr(args.compute_scale)]
    # Locally every rank is on this one host: the hosts become emulated nodes, as on the cluster.
    return cmd + (["--ranks-per-node", str(args.ranks_per_host)] if args.local else [])


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def spread(row, path: str) -> str:
    return f"{ms(row[path + '_s'])} ({ms(row[path + '_min_s'])}–{ms(row[path + '_max_s'])})"


def markdown(rows) -> str:
    head = ("| layer | K | P | sfb ms (min–max) | ps ms (min–max) | faster | predicted | predicted sfb ms "
            "| predicted ps ms | agree |\n|---|---:|---:|---:|---:|---|---|---:|---:|---|")
    body = [f"| {r['layer']} {r['M']}×{r['N']} | {r['K']} | {r['P']} | {spread(r, 'sfb')} | {spread(r, 'ps')} | "
            f"{r['measured_faster']}{'' if r['separated'] else '*'} | {r['predicted']} | "
            f"{ms(r['predicted_sfb_s'])} | {ms(r['predicted_ps_s'])} | {'✓' if r['agree'] else '✗'} |" for r in rows]
    return "\n".join([head, *body])


def summarize(rows) -> dict:
    """How often the cost model picked the path that measured faster; the misses, and those within noise."""
    misses = [r for r in rows if not r["agree"]]
    return dict(cases=len(rows), agree=len(rows) - len(misses), unseparated=sum(not r["separated"] for r in rows),
                misses=[dict(layer=r["layer"], K=r["K"], P=r["P"], within_noise=not r["separated"]) for r in misses])


def miss_line(r) -> str:
    """A miss with what it takes to see why: both measurements, both prices, the rebuild priced and measured."""
    noise = ", within noise: the rounds' ranges overlap" if not r["separated"] else ""
    modelled = r.get("rebuild_modelled_s")  # emulated compute: the device's own time for this rebuild
    priced = "priced at wrap" if modelled is None else r["gflops_source"]
    return (f"- {r['layer']} {r['M']}×{r['N']} K={r['K']} P={r['P']}: measured sfb {spread(r, 'sfb')} ms, "
            f"ps {spread(r, 'ps')} ms: {r['measured_faster']} faster{noise}; predicted sfb "
            f"{ms(r['predicted_sfb_s'])} ms (rebuild {ms(r['predicted_rebuild_s'])} ms at {r['gflops']:.1f} GFLOP/s "
            f"{priced}; alone it took {ms(r['rebuild_s'])} ms, {r['rebuild_gflops']:.1f} GFLOP/s"
            + (f", the device's model {modelled * 1e3:.3f} ms" if modelled is not None else "") + "), ps "
            f"{ms(r['predicted_ps_s'])} ms: {r['predicted']}; measured/predicted sfb "
            f"×{r['sfb_s'] / r['predicted_sfb_s']:.2f}, ps ×{r['ps_s'] / r['predicted_ps_s']:.2f}")


def report(rows, summary) -> str:
    lines = [f"the cost model picked the faster path in {summary['agree']} of {summary['cases']} cases"]
    if summary["unseparated"]:
        lines.append(f"(* {summary['unseparated']} case{'s' * (summary['unseparated'] > 1)} where the rounds' "
                     "ranges overlap: more --rounds to separate them)")
    misses = [r for r in rows if not r["agree"]]
    if misses:
        lines += ["", "misses:", *map(miss_line, misses)]
    return "\n".join(lines)


def crossover(rows) -> tuple[float, float] | None:
    """(K, seconds) where the predicted sfb and ps lines cross: sfb's price grows as K, ps's does not."""
    r = next((r for r in rows if r["predicted_sfb_s"] > 0), None)
    if r is None:
        return None
    return r["K"] * r["predicted_ps_s"] / r["predicted_sfb_s"], r["predicted_ps_s"]


def plot(rows, path, title: str = ""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(dict.fromkeys((r["layer"], r["M"], r["N"]) for r in rows))
    ranks = list(dict.fromkeys(r["P"] for r in rows))
    fig, axes = plt.subplots(1, len(layers), figsize=(5 * len(layers), 4.2), squeeze=False)
    for ax, (name, M, N) in zip(axes[0], layers):
        for j, P in enumerate(ranks):
            pts = sorted((r for r in rows if r["layer"] == name and r["P"] == P), key=lambda r: r["K"])
            if not pts:
                continue
            marker = MARKERS[j % len(MARKERS)]
            ks = [r["K"] for r in pts]
            for color, p in (("C0", "sfb"), ("C1", "ps")):
                ax.errorbar(ks, [r[f"{p}_s"] for r in pts], capsize=2, color=color, marker=marker,
                            yerr=[[r[f"{p}_s"] - r[f"{p}_min_s"] for r in pts],
                                  [r[f"{p}_max_s"] - r[f"{p}_s"] for r in pts]], label=f"{p} P={P}")
            cross = crossover(pts)
            if cross is not None:
                label = f"predicted crossover P={P}: K={cross[0]:.3g}"
                if ks[0] / 8 <= cross[0] <= ks[-1] * 8:
                    ax.axvline(cross[0], color="0.5", linestyle=":", linewidth=1)
                    ax.plot(*cross, marker=marker, color="k", markerfacecolor="none", markersize=9,
                            linestyle="none", label=label)
                else:  # drawn there, it would squash the measured K into a corner: named only
                    ax.plot([], [], marker=marker, color="k", markerfacecolor="none", linestyle="none",
                            label=label + " (off the axis)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{name} ({M}×{N})")
        ax.set_xlabel("K, rows per rank per step")
        ax.set_ylabel("seconds per step (median, min–max)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    if title:  # wrapped to the figure's width, line by line: the compute's label is long
        width = int(fig.get_figwidth() * 14)
        fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    compute = Compute.from_args(args).label
    print(f"# {compute}", flush=True)
    runs = [(args.model, P) for P in args.ranks]
    rows, failed = sweep(args, lambda _model, label, _ranks: worker_cmd(args, label), markdown,
                         args.ranks_per_host, runs)
    if not rows:  # a run failed before any row came (bad input was refused before the sweep: not 2)
        return 1
    summary = summarize(rows)
    # What the figures were measured on, and under which compute: the table's and the figure's title.
    heading = "\n".join(filter(None, [incomplete_note(failed), compute, machine_line(machine())]))
    print(f"\n{heading}\n" + markdown(rows) + "\n\n" + report(rows, summary))
    meta = run_metadata("jobs.bench.hybcomm_choice", argv, machine=machine(), model=args.model, bandwidth_bps=args.bps,
                        ranks_per_host=args.ranks_per_host, local=args.local, summary=summary, compute_label=compute,
                        **{k: rows[0][k] for k in ("compute", "compute_device", "compute_scale")},
                        **incomplete_meta(failed))
    write_results(None, args, meta, rows, lambda path: plot(rows, path, heading))
    return exit_status(failed)


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
