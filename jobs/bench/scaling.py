r"""Benchmark: the scaling curve, each strategy's samples/s on 1, 2, 4, 8 ... ranks over emulated links.

    mpitrain bench scaling --models vgg19-22k --strategies wfbp,p3,hybcomm,ddp --ranks 1,2,4,8 \
        --ranks-per-host 1 --bandwidth 10gbit --batch-size 8 --json results/scaling.json   # as root
    mpitrain bench scaling --local --models mlp --strategies allreduce,wfbp --ranks 1,2  # no root
    mpitrain bench scaling --models vgg19-224 --strategies wfbp,ddp --compute emulated:v100   # modelled V100s

For every bandwidth and rank count n, an emulated cluster of ceil(n / --ranks-per-host)
hosts runs jobs.bench.strategies_worker with every strategy (one rank alone runs on this host,
with no cluster; --local runs every count here, unshaped). Prints a table: samples/s
± 95 % CI, the speed-up over the same strategy on the fewest ranks n0 (normally 1)
and the scaling efficiency samples/s(n) / (n / n0 x samples/s(n0)); writes the
worker's JSON rows with speedup and efficiency added, and a PNG of samples/s
against ranks, one line per strategy, linear scaling dashed.

--compute emulated:DEVICE (or emulated:PROFILE.json, --compute-scale): every rank's model, loss and
optimizer wait a modelled GPU's time instead of computing (runtime.emulate, in the strategies worker), so
the ranks' CPUs stay free for the communication as a GPU host's do. The table's title, the JSON (rows:
compute, compute_device, compute_scale, emulated_parts, real_parts; the meta) and the plot name the compute.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from jobs.bench import strategies as bench
from jobs.common.cluster_sweep import sweep
from jobs.common.compute import Compute, add_compute_arguments, check_compute
from jobs.common.inputs import (InputError, JobParser, add_cluster_bench_arguments, cluster_bench_outputs, int_list,
                                parse)
from jobs.common.outputs import write_results
from jobs.common.report import run_metadata, save_figure

DEFAULT_BANDWIDTHS = "10gbit"


def parse_args(argv=None):
    """The checked command line: everything the worker would refuse is refused here, before a cluster is up."""
    p = JobParser(prog="python -m jobs.bench.scaling", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    bench.add_worker_arguments(p, "vgg19-22k", "wfbp,p3,hybcomm,ddp", batch_size=8, emulated=True)
    p.add_argument("--ranks", default="1,2,4,8", help="world sizes, increasing (default 1,2,4,8)")
    add_cluster_bench_arguments(p, DEFAULT_BANDWIDTHS)
    add_compute_arguments(p)
    return parse(p, argv, check_args)


def check_args(args) -> None:
    bench.check_worker_arguments(args)
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


def add_scaling(rows: list[dict]) -> None:
    """Each row's speedup and efficiency against the same model, bandwidth and strategy on the fewest ranks."""
    base: dict[tuple, dict] = {}
    for r in sorted(rows, key=lambda r: r["ranks"]):
        b = base.setdefault((r["model"], r["bandwidth"], r["strategy"]), r)
        r["baseline_ranks"] = b["ranks"]
        r["speedup"] = r["samples_per_s"] / b["samples_per_s"]
        r["efficiency"] = r["speedup"] * b["ranks"] / r["ranks"]


def markdown(rows) -> str:
    head = ("| model | bandwidth | strategy | ranks | samples/s | ±95 % | speed-up | efficiency | wire MB/step |\n"
            "|---|---|---|---:|---:|---:|---:|---:|---:|")
    order = sorted(rows, key=lambda r: (r["model"], r["bandwidth"], r["strategy"], r["ranks"]))
    body = [f"| {r['model']} | {r['bandwidth']} | {r['strategy']} | {r['ranks']} | {r['samples_per_s']:.1f} | "
            f"{r['ci']:.1f} | {r['speedup']:.2f} | {r['efficiency']:.2f} | {bench.mb(r, 'wire_bytes_per_step')} |"
            for r in order]
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
            ax.errorbar([r["ranks"] for r in pts], [r["samples_per_s"] for r in pts], yerr=[r["ci"] for r in pts],
                        marker="o", capsize=3, label=strategy)
        best = max(r["samples_per_s"] for r in mine if r["ranks"] == ranks[0])
        ax.plot(ranks, [n / ranks[0] * best for n in ranks], "k--", linewidth=1, label="linear scaling")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks, [str(n) for n in ranks])
        ax.minorticks_off()
        ax.set_title(f"{model} at {bw}")
        ax.set_xlabel("ranks")
        ax.set_ylabel("samples/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if title:  # wrapped to the figure's width: the compute's label is long
        fig.suptitle(textwrap.fill(title, int(fig.get_figwidth() * 14)), fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    compute = Compute.from_args(args)
    print(f"# {compute.label}", flush=True)
    runs = [(model, n) for n in args.ranks for model in args.models]
    rows = sweep(args, lambda model, label, n: worker_cmd(args, model, label, n), bench.markdown,
                 args.ranks_per_host, runs)
    if rows is None:
        return 2
    add_scaling(rows)
    for r in rows:  # the worker's own fields first (its accelerator knows what it emulated)
        for k, v in compute.describe().items():
            r.setdefault(k, v)
    print(f"\n{compute.label}\n" + markdown(rows))
    meta = run_metadata("jobs.bench.scaling", argv, compute_label=compute.label,
                        **{k: rows[0][k] for k in ("compute", "compute_device", "compute_scale")})
    write_results(None, args, meta, rows, lambda path: plot(rows, path, compute.label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
