r"""Benchmark: allreduce vs wfbp vs p3 vs hybcomm vs torch DDP, training throughput across link bandwidths.

    mpitrain bench strategies --json results/bench.json                       # as root: emulated cluster
    mpitrain bench strategies --models vgg19 --bandwidths 1gbit,2.5gbit,none --hosts 4
    mpitrain bench strategies --local --models mlp                            # no root: this host, unshaped
    mpitrain bench strategies --local --hosts 4 --models mlp --rounds 6       # 6 rounds: 95 % CIs of the medians
    mpitrain bench strategies --models vgg19 --bandwidths 1gbit --hosts 2 --ranks-per-host 2 \
        --strategies allreduce,topk,hier-topk --density 0.001             # sparse strategies, 2 nodes
    mpitrain bench strategies --models vgg19,transformer --bandwidths 1gbit,2.5gbit,10gbit,none \
        --strategies p3,p3@262144/8,p3@1048576/4,ddp --rounds 5      # p3's auto settings against fixed ones
    mpitrain bench strategies --models vgg19-22k --bandwidths 1gbit,10gbit \
        --strategies wfbp,hybcomm,hybcomm-sfb,hybcomm-ps                  # Poseidon's choice vs forced
    mpitrain bench strategies --compute emulated:v100 --models resnet50-224 --hosts 8 \
        --strategies wfbp/1,wfbp/2,wfbp/all                               # wfbp's buckets under way at once
    mpitrain bench strategies --device cuda --models vgg19,resnet50 --hosts 2 --ranks-per-host 2 \
        --bandwidths 1gbit,10gbit,none                                    # on GPUs (ranks may share one)
    mpitrain bench strategies --compute emulated:h100 --models vgg19-224 --bandwidths 1gbit --hosts 4
    mpitrain bench strategies --compute emulated:v100 --models vgg19-224,resnet50-224 \
        --bandwidths 10gbit,25gbit --carry-at 1gbit                       # 10 and 25 Gbit/s, carried at 1

For every bandwidth an emulated cluster of --hosts hosts (--ranks-per-host each) is
brought up, jobs.bench.strategies_worker runs every model and strategy across it, and
the cluster is taken down again. The worker measures in --rounds rounds, the
contenders (the plain step and each strategy) interleaved in rotating order,
so that a slow spell of a shared machine falls on all of them: every figure
is the median over rounds, with its distribution-free CI (order statistics,
jobs.common.stats; below 6 rounds the rounds' min-max, whose coverage the title
states). Overlap is computed per round from that round's T_compute, T_comm
and T_iter: the share of the shorter phase hidden behind the longer, in
[0, 1] (jobs.bench.strategies_rows.overlap says why not max(T_compute, T_comm) /
T_iter). Prints the machine (CPU model, cores, memory) and torch threads per
rank (--threads) above a markdown table, writes JSON rows (model, strategy,
bandwidth, ranks, rounds, threads, samples_per_s, ci (±, covering
samples_per_s_ci), t_iter_s, t_compute_s, t_comm_s, overlap_efficiency, each
with its _ci, compute_cpu_s, comm_cpu_s, comm_cpu_vs_ddp, the per-round values
(*_rounds_s, overlap_rounds, t_iter_batches_s), wire_bytes_per_step,
wire_bytes_per_host_per_step; hybcomm's rows: plan; meta: the machine) and a
PNG of samples/s vs bandwidth (its title: the compute and the machine). A run that
fails ends the sweep with one error line: the rows measured are still written, the
meta says incomplete and names failed_runs, and the exit status is 1. "step CPU s" is the CPU-seconds per training
step of all ranks' processes (every thread, user and system: progress
threads, polling and the system calls that move the bytes included), "comm
CPU s" the same for the synchronisation alone, "× DDP's" that over DDP's (per
round, median). "CPU bound" is (compute + communication CPU-seconds per
step) / cores: on a machine where ranks and the network stack share few
cores, no overlap can make a step shorter than that. "wire MB/step" is what
the hosts' interfaces sent per step, all hosts together (the emulated
cluster only). hybcomm's plan (sufficient factors or PS per layer) is
printed under the table once per model and bandwidth. With --device cuda
the ranks train on GPUs (local rank % GPUs); rows carry device, device_name,
cuda and transport (how gradients reach the network), and the table's
title line names the device.

With --compute emulated:DEVICE (or emulated:PROFILE.json; jobs.common.compute)
every contender's layers, loss and optimizer wait the time DEVICE would take,
times --compute-scale, instead of computing (runtime.emulate): the ranks'
CPUs stay free for the communication, as a GPU host's do. The table title,
the JSON meta and the PNG name the compute mode; every row carries it
(compute, compute_device, compute_scale, emulated_parts, real_parts), the
modelled device seconds per step ("modelled s"; per kind in
modelled_parts_s), the peak resident memory ("peak RSS MB": the largest
rank's, peak_rss_ranks_mb all ranks' summed) and ranks_per_core. Under
emulation the batch defaults to the model's paper batch (PAPER_BATCH, else
16), and models of 50 M parameters or more default to --warmup 1 --batches 2
--iters 1 --rounds 2 (VGG-19 at 224x224 sends 575 MB per step: seconds at
1 Gbit/s); given values win. --carry-at RATE (emulated compute only) runs every
--bandwidths B on links of RATE with the compute B/RATE times slower and
reports the figures at B (jobs.common.carry: times divided, samples/s
multiplied by B/RATE; CPU-seconds and bytes as measured); rows carry
carried_at ("1 Gbit/s links, compute x10"), carry_factor and carried_links.
"""

from __future__ import annotations

import argparse
import sys

from jobs.bench.contenders import check_settings
from jobs.common import carry
from jobs.common.choices import MODELS
from jobs.common.cluster_sweep import exit_status, incomplete_meta, incomplete_note, sweep
from jobs.common.compute import Compute, add_compute_arguments, check_compute
from jobs.common.inputs import (JobParser, add_cluster_bench_arguments, add_device_argument, at_least, check_device,
                                cluster_bench_outputs, comma_list, parse)
from jobs.common.outputs import write_together
from jobs.common.plans import plan_markdown
from jobs.common.report import machine, machine_line, run_metadata, save_figure, write_json

DEFAULT_BANDWIDTHS = "0.5gbit,1gbit,2.5gbit,10gbit,none"
# The steps per contender and round, and the rounds, when not given: as measured on the CPU, and under emulated
# compute for a model of BIG_MODEL parameters or more. VGG-19 at 224x224 sends 575 MB per step, 7.6 s at
# 1 Gbit/s on 4 hosts, and each contender's wrapping broadcasts the model once more: 54 s per contender and
# round with these steps, so that 4 strategies x 2 rounds take about 8 minutes (3 rounds took 11).
STEPS = dict(batches=5, iters=2, warmup=2, rounds=3)
BIG_STEPS = dict(batches=2, iters=1, warmup=1, rounds=2)
BIG_MODEL = 50_000_000


def parse_args(argv=None):
    """The checked command line: everything the worker would refuse is refused here, before a cluster is up."""
    p = JobParser(prog="python -m jobs.bench.strategies", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    add_worker_arguments(p, "vgg19,resnet50,transformer", "allreduce,wfbp,p3,ddp", batch_size=16, emulated=True)
    p.add_argument("--hosts", type=int, default=4,
                   help="default 4; with --local, emulated nodes of --ranks-per-host ranks on this host")
    add_cluster_bench_arguments(p, DEFAULT_BANDWIDTHS)
    add_compute_arguments(p)
    carry.add_carry_argument(p)
    return parse(p, argv, check_args)


def add_worker_arguments(p, models: str, strategies: str, batch_size: int, emulated: bool = False) -> None:
    """What a driver of jobs.bench.strategies_worker hands it (strategies, scaling); check_worker_arguments checks.

    emulated: the driver takes --compute, and the step counts and batch not given default per model
    (run_settings).
    """
    p.add_argument("--models", default=models, help=f"default {models}")
    p.add_argument("--strategies", default=strategies, help=f"default {strategies}")
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument("--density", type=float, default=0.001, help="topk/hier-topk: fraction sent (default 0.001)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    big = f"; emulated compute, {BIG_MODEL // 10 ** 6} M parameters or more: " if emulated else ""
    p.add_argument("--batch-size", type=int, default=None if emulated else batch_size,
                   help=f"samples per rank per step (default {batch_size}"
                        + ("; emulated compute: the model's paper batch if it has one)" if emulated else ")"))
    p.set_defaults(real_batch_size=batch_size)  # run_settings' default where the compute is real
    for name, what in (("batches", "timed batches per contender and round"), ("iters", "steps per timed batch"),
                       ("warmup", "untimed steps per contender and round"),
                       ("rounds", "interleaved rounds over the contenders, in rotating order (95 %% CIs from 6)")):
        p.add_argument(f"--{name}", type=int, default=None if emulated else STEPS[name],
                       help=f"{what} (default {STEPS[name]}" + (f"{big}{BIG_STEPS[name]})" if big else ")"))
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--slice-size", default="auto", help="p3: elements per slice, or auto (default: from the link)")
    p.add_argument("--credit", default="auto",
                   help="p3: messages in flight, auto (default: from the link) or online (tried)")
    add_device_argument(p)


def check_worker_arguments(args) -> None:
    """What the worker would refuse; --device last (cuda imports torch)."""
    args.models = comma_list("--models", args.models, MODELS)
    check_settings(args)
    at_least(args, 1, "ranks_per_host")
    check_device(args)


def check_args(args) -> None:
    check_worker_arguments(args)
    at_least(args, 1, "hosts")
    check_compute(args)
    cluster_bench_outputs(args, DEFAULT_BANDWIDTHS)
    carry.check_carry(args)


def run_settings(args, model: str) -> dict:
    """The batch and step counts a model runs with: as given, else the defaults (per model under emulation)."""
    emulated = getattr(args, "compute", "real") != "real"
    steps = BIG_STEPS if emulated and parameters(model) >= BIG_MODEL else STEPS
    out = {k: steps[k] if getattr(args, k) is None else getattr(args, k) for k in steps}
    batch = args.batch_size
    if batch is None:
        from runtime.workloads.models import PAPER_BATCH

        real = getattr(args, "real_batch_size", 16)
        batch = PAPER_BATCH.get(model, real) if emulated else real
    return dict(out, batch_size=batch)


def parameters(model: str) -> int:
    """The model's parameter count, built on the meta device (no memory, no initialisation)."""
    import torch

    from runtime.workloads.models import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(model).parameters())


def worker_cmd(args, model, label, ranks):
    s = run_settings(args, model)
    cmd = [sys.executable, "-m", "jobs.bench.strategies_worker", "--model", model, "--strategies", args.strategies,
           "--batch-size", str(s["batch_size"]), "--batches", str(s["batches"]), "--iters", str(s["iters"]),
           "--warmup", str(s["warmup"]), "--bandwidth", label, "--density", str(args.density),
           "--optimizer", args.optimizer, "--device", args.device, "--rounds", str(s["rounds"]),
           "--threads", str(args.threads)]
    cmd += ["--slice-size", str(args.slice_size), "--credit", str(args.credit)]
    if getattr(args, "compute", "real") != "real":  # carried: the compute slowed as the links are
        cmd += ["--compute", args.compute, "--compute-scale", repr(args.compute_scale * carry.factor(args, label))]
    # Locally every rank is on this one host: the hosts become emulated nodes (for hier-topk's two levels).
    return cmd + (["--ranks-per-node", str(args.ranks_per_host)] if args.local and ranks > 1 else [])


# What --carry-at reports at the asked bandwidth (jobs.common.carry): times divided, rates multiplied.
CARRIED_TIMES = ("t_iter_s", "t_iter_ci", "t_compute_s", "t_compute_ci", "t_comm_s", "t_comm_ci", "t_iter_rounds_s",
                 "t_compute_rounds_s", "t_comm_rounds_s", "t_iter_batches_s", "modelled_compute_s", "modelled_parts_s")
CARRIED_RATES = ("samples_per_s", "ci", "samples_per_s_ci")

OVERLAP = ("overlap eff. = max(T_compute, T_comm) / T_iter (at most 1), hidden share = (T_compute + T_comm - T_iter) "
           "/ min(T_compute, T_comm) (in [0, 1])")


def report_at(args, rows, label: str) -> None:
    """A run's rows as at the bandwidth asked (a carried one's figures scaled: jobs.common.carry), with the compute
    scale asked: what the workers ran with besides is in carried_at."""
    carry.report_at(args, rows, label, CARRIED_TIMES, CARRIED_RATES)
    if getattr(args, "carry_at_bps", None) is not None:
        for r in rows:
            r.update(compute_scale=args.compute_scale, compute_label=compute_label(args))


def markdown(rows) -> str:
    """The rows' table: medians over rounds, (low-high) their CIs (title() says which); two header lines."""
    carried = any(r.get("carried_at") for r in rows)
    carried_head = " carried at |" if carried else ""
    head = ("| model | strategy | bandwidth | samples/s | (CI) | T_iter s | T_compute s | T_comm s "
            "| overlap eff. | hidden share | compute CPU s | step CPU s | comm CPU s | comm CPU × DDP's "
            "| CPU bound s | inter-node MB/step | wire MB/step | modelled s | peak RSS MB |" + carried_head + "\n"
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            + "---|" * bool(carried_head))
    body = [f"| {r['model']} | {r['strategy']} | {r['bandwidth']} | {r['samples_per_s']:.1f} | "
            f"{spread(r['samples_per_s_ci'], 1)} | {with_ci(r, 't_iter', 4)} | {with_ci(r, 't_compute', 4)} | "
            f"{with_ci(r, 't_comm', 4)} | {with_ci(r, 'overlap', 2, 'overlap_efficiency')} | "
            f"{with_ci(r, 'hidden_share', 2, 'hidden_share')} | "
            f"{r['compute_cpu_s']:.3f} | {num(r.get('step_cpu_s'), 3)} | {num(r['comm_cpu_s'], 3)} | "
            f"{num(comm_cpu_vs_ddp(r, rows), 2)} | "
            f"{cpu_bound(r)} | {mb(r, 'inter_node_bytes_per_step')} | {mb(r, 'wire_bytes_per_step')} | "
            f"{num(r.get('modelled_compute_s'), 4)} | {num(r.get('peak_rss_mb'), 0)} |"
            + (f" {r.get('carried_at') or '-'} |" if carried else "")
            for r in rows]
    return "\n".join([head, *body])


def title(rows, args) -> str:
    """What the table is: the machine, the threads, the rounds and how to read the intervals and the overlap."""
    from jobs.common.stats import coverage_text

    rounds = sorted({r["rounds"] for r in rows})
    how = ", ".join(coverage_text(n) for n in rounds)
    per_core = "/".join(f"{v:g}" for v in dict.fromkeys(round(r["ranks_per_core"], 2) for r in rows
                                                         if r.get("ranks_per_core") is not None))
    carried = carry.title_line(args)
    return (f"{device_title(rows)}; {compute_label(args)}\n{machine_line(machine())}"
            + (f"; ranks per usable core: {per_core}" if per_core else "")
            + f"; {args.threads} torch thread{'s' * (args.threads > 1)} per rank\n"
            + (carried + "\n" if carried else "") +
            f"median of {'/'.join(map(str, rounds))} rounds (contenders interleaved, rotating order); "
            f"(low-high): the rounds' order statistics, for the median {how}; "
            f"{OVERLAP}, each per round")


def compute_label(args) -> str:
    """`emulated compute: ... H100 ..., compute x2` or `real compute`: what the figures' compute was."""
    return Compute(args.compute, args.compute_scale).label


def with_ci(row, key: str, digits: int, median_key: str | None = None) -> str:
    """`0.0173 (0.0147-0.0199)`: a median and its CI; "-" where the worker could not measure it."""
    value = row[median_key or f"{key}_s"]
    return "-" if value is None else f"{value:.{digits}f} {spread(row[f'{key}_ci'], digits)}"


def spread(ci, digits: int) -> str:
    return f"({ci[0]:.{digits}f}-{ci[1]:.{digits}f})"


def comm_cpu_vs_ddp(row, rows) -> float | None:
    """The strategy's communication CPU-seconds per step over DDP's (same model and bandwidth): per-round ratio, median.

    Each round's pair was measured in the same round, so a busy round weighs on both. A DDP round that
    read 0 is left out; None without DDP or a reading.
    """
    import statistics

    ddp = next((r for r in rows if r["strategy"] == "ddp" and (r["model"], r["bandwidth"]) ==
                (row["model"], row["bandwidth"])), None)
    if ddp is None or row.get("comm_cpu_rounds_s") is None:
        return None
    ratios = [a / b for a, b in zip(row["comm_cpu_rounds_s"], ddp["comm_cpu_rounds_s"]) if b > 0]
    return statistics.median(ratios) if ratios else None


def device_title(rows) -> str:
    """`devices: cuda (NVIDIA H100 80GB HBM3), CUDA 12.8`: what the rows ran on (the workers report it)."""
    seen = dict.fromkeys(r["device"] + (f" ({r['device_name']}), CUDA {r['cuda']}" if r["device"] == "cuda" else "")
                         for r in rows)
    return f"devices: {'; '.join(seen) or 'unknown'}"


def num(value: float | None, digits: int) -> str:
    """A measured figure, or "-" where the worker could not measure it (hybcomm's T_comm and overlap)."""
    return "-" if value is None else f"{value:.{digits}f}"


def mb(row, key: str) -> str:
    """A bytes-per-step column in MB; "-" where the row has none (inter-node: sparse only; wire: emulated hosts)."""
    b = row.get(key)
    return "-" if b is None else f"{b / 1e6:.2f}"


def p3_lines(rows) -> str:
    """What each p3 contender chose (auto or given) and what it cost per step: messages sent, polls."""
    def count(value) -> str:
        return "-" if value is None else f"{value:.0f}"
    return "\n".join(f"{r['strategy']}, {r['model']} at {r['bandwidth']}: {r['p3_settings']}; per step "
                     f"{count(r['p3_messages_per_step'])} messages sent and {count(r['p3_polls_per_step'])} polls "
                     f"per rank ({count(r['p3_comm_polls_per_step'])} polls when only synchronising)"
                     for r in rows if r.get("p3_settings"))


def plans(rows) -> str:
    """hybcomm's plan once per model and bandwidth: the cost model's own (hybcomm) if it ran, else a forced one."""
    chosen: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["bandwidth"])
        if r.get("plan") is not None and (key not in chosen or r["strategy"] == "hybcomm"):
            chosen[key] = r
    return "\n\n".join(f"hybcomm plan, {model} at {bw} ({r['strategy']}):\n{plan_markdown(r['plan'])}"
                       for (model, bw), r in chosen.items())


def cpu_bound(row) -> str:
    """Lowest T_iter the machine's cores allow: compute and communication CPU-seconds share them."""
    if row.get("comm_cpu_s") is None:
        return "-"
    return f"{(row['compute_cpu_s'] + row['comm_cpu_s']) / row['cores']:.3f}"


def plot(rows, path, title: str = ""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        labels = list(dict.fromkeys(r["bandwidth"] for r in rows if r["model"] == model))
        for strategy in dict.fromkeys(r["strategy"] for r in rows):
            pts = {r["bandwidth"]: r for r in rows if r["model"] == model and r["strategy"] == strategy}
            xs = [i for i, b in enumerate(labels) if b in pts]
            rates = [pts[labels[i]]["samples_per_s"] for i in xs]
            cis = [pts[labels[i]]["samples_per_s_ci"] for i in xs]
            ax.errorbar(xs, rates, yerr=[[r - lo for r, (lo, _) in zip(rates, cis)],
                                         [hi - r for r, (_, hi) in zip(rates, cis)]],
                        marker="o", capsize=3, label=strategy)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(model)
        ax.set_xlabel("link bandwidth per host")
        ax.set_ylabel("samples/s (median of rounds, CI)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:  # wrapped: one panel is narrower than the compute model's name
        import textwrap

        fig.suptitle("\n".join(textwrap.fill(line, 64 * len(models)) for line in title.split("\n")), fontsize=8)
    save_figure(fig, path)


def figure_title(args, failed: list[dict]) -> str:
    """The PNG's title: a failed run (jobs.common.cluster_sweep), the compute and carry, the machine."""
    label = compute_label(args) + (f"; carried at {args.carry_at} links" if args.carry_at else "")
    return "\n".join(filter(None, [incomplete_note(failed), label, machine_line(machine())]))


def main(argv=None) -> int:
    args = parse_args(argv)
    rows, failed = sweep(args, lambda model, label, ranks: worker_cmd(args, model, label, ranks), markdown,
                         args.ranks_per_host, links=lambda bw: carry.links(args, bw),
                         adjust=lambda new, label: report_at(args, new, label))
    if not rows:  # a run failed before any row came (bad input was refused before the sweep: not 2)
        return 1
    note = incomplete_note(failed)
    for r in rows:
        r["comm_cpu_vs_ddp"] = comm_cpu_vs_ddp(r, rows)
    print("\n" + (note + "\n" if note else "") + title(rows, args) + "\n" + markdown(rows))
    if plans(rows):
        print("\n" + plans(rows))
    if p3_lines(rows):
        print("\n" + p3_lines(rows))
    if args.json:
        rounds = sorted({r["rounds"] for r in rows})
        meta = run_metadata("jobs.bench", argv, machine=machine(), rounds=rounds[0] if len(rounds) == 1 else rounds,
                            threads=args.threads,
                            **Compute(args.compute, args.compute_scale).describe(), compute_label=compute_label(args),
                            carry_at=args.carry_at, carried=carry.title_line(args) or None,
                            overlap_efficiency=OVERLAP,
                            ci="order statistics of the rounds (jobs.common.stats.median_ci)", **incomplete_meta(failed))
        for parts in ("emulated_parts", "real_parts"):  # what the workers' accelerators ran (the driver has none)
            meta[parts] = sorted({p for r in rows for p in r.get(parts) or ()})
        write_together(None, "--json", args.json, lambda: write_json(args.json, meta, rows))
    if args.plot and rows:
        write_together(None, "--plot", args.plot,
                       lambda: (plot(rows, args.plot, figure_title(args, failed)), print(f"wrote {args.plot}")))
    return exit_status(failed)


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
