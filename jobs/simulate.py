r"""The cluster simulator: project each strategy to clusters no machine here can host, or check it against real runs.

    mpitrain simulate --model vgg19 --nodes 16,32,64,128 --ranks-per-node 8 \
        --bandwidth 10gbit,25gbit,100gbit --json results/projection.json          # projection
    mpitrain simulate --model vgg19 --profile my-gpu-profile.json --nodes 16 --ranks-per-node 8
    mpitrain simulate --model resnet50-224 --compute emulated:h100 --nodes 16,128  # a device model's compute
    mpitrain simulate --take-profile --model resnet50 --ranks 4 --out resnet50-r4.json
    mpitrain simulate --take-profile --device cuda --model vgg19 --out vgg19-gpu.json   # a GPU's
    mpitrain simulate --validate --json results/validation.json           # as root: emulated cluster
    mpitrain simulate --validate --measured benchmarks/issue15/measured-4r-1gbit.json ...
    mpitrain simulate --papers --json benchmarks/claims/papers.json       # the papers' figures beside ours

Projection: the model's profile (--profile; by default one taken here on one
rank, kept in ~/.cache/mpitrain/profiles) runs through runtime.sim for every
strategy, node count and bandwidth: a table of samples/s, the speed-up over
the fewest nodes and the scaling efficiency, JSON rows and a PNG with a
panel per bandwidth (samples/s against nodes, one line per strategy, linear
scaling dashed, the compute named in the title). A pipeline that does not
fit a node count is skipped with a line on stderr (none fitting at all is an
error). --compute-speedup N makes compute N times as fast as profiled (a GPU
from a CPU profile; --compute-scale, which --validate, train and the
benchmarks take, makes emulated compute N times *slower*, so projection
refuses it); --latency, --oversubscription and --intra-bandwidth describe the
network; --calibration (a JSON of jobs.sim.worker transport, as --validate
writes) adds the measured per-connection rate and CPU cost per byte, which
by default are not limits (RDMA-class networks). --compute emulated:DEVICE
(or emulated:PROFILE.json) takes the compute from the device model that
--compute emulated runs wait on (runtime.emulate.sim_profile), at the model's
paper batch unless --batch-size says otherwise: no profiling run.

--validate runs jobs.sim.validate (its own help: python -m jobs.sim.validate -h
lists the options it takes through this job); --papers runs jobs.sim.papers (the
four papers' setups on their GPUs' device models, their figures beside ours).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jobs.common.choices import MODELS
from jobs.common.inputs import (InputError, JobParser, at_least, bench_outputs, comma_list, fraction, int_list,
                                link_rate, one_of, parse, positive_finite)
from jobs.sim.profiles import take_profile

DEFAULT_STRATEGIES = "allreduce,wfbp,ddp,p3,hybcomm,topk,hier-topk,allreduce+pto,pipeline-flush,pipeline-spectrain"
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mpitrain", "profiles")


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.simulate", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default="vgg19", help="default vgg19")
    p.add_argument("--profile", metavar="JSON", help="a profile (jobs.simulate --take-profile, runtime.sim.measure)")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES, help=f"default {DEFAULT_STRATEGIES}")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64,128")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--bandwidth", "--bandwidths", dest="bandwidth", default="10gbit,25gbit,100gbit")
    p.add_argument("--latency", type=float, default=30e-6, help="seconds per message (default 30e-6)")
    p.add_argument("--intra-bandwidth", default="100gbit", help="between ranks of a node (default 100gbit)")
    p.add_argument("--oversubscription", type=float, default=1.0)
    p.add_argument("--send-buffer", type=float, default=0.0, metavar="BYTES",
                   help="bytes a connection takes before a send completes: an eager transport's socket buffer "
                        "(flat p3, simulated rank by rank up to 32 ranks; default 0: rendezvous)")
    p.add_argument("--compute-speedup", type=float, default=1.0, metavar="N",
                   help="compute N times as fast as profiled (default 1)")
    # Taken only to refuse it with a pointer: elsewhere it means N times *slower* (jobs.common.compute).
    p.add_argument("--compute-scale", type=float, help=argparse.SUPPRESS)
    p.add_argument("--cores-per-host", type=float, help="default: two per rank")
    p.add_argument("--calibration", metavar="JSON", help="transport costs measured by jobs.sim.validate")
    p.add_argument("--batch-size", type=int, help="of a profile taken here or modelled (default 16; modelled: the "
                                                  "model's paper batch if it has one)")
    p.add_argument("--compute", default="real", help="real (a profile: --profile, or one taken here), or "
                   "emulated:DEVICE / emulated:PROFILE.json (runtime.emulate's compute model)")
    p.add_argument("--density", type=float, default=1e-3, help="topk/hier-topk (default 0.001)")
    p.add_argument("--take-profile", action="store_true", help="profile --model on --ranks ranks here, write --out")
    p.add_argument("--ranks", type=int, default=1, help="--take-profile: ranks computing at once (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="--take-profile: where (default cpu)")
    p.add_argument("--out", help="--take-profile: the profile's path")
    p.add_argument("--validate", action="store_true", help="see jobs.sim.validate")
    p.add_argument("--papers", action="store_true", help="see jobs.sim.papers")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed for --take-profile's run")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG", help="default: the JSON path with .png")
    return parse(p, argv, check_args)


def check_args(args) -> None:
    one_of("--model", args.model, MODELS)
    if args.batch_size is None:
        from runtime.workloads.models import PAPER_BATCH

        args.batch_size = PAPER_BATCH.get(args.model, 16) if args.compute != "real" else 16
    if args.compute != "real":
        if args.profile:
            raise InputError("--profile", "a profile or --compute emulated:..., not both")
        from runtime.emulate import EmulationError, compute_model

        if not args.compute.startswith("emulated:"):
            raise InputError("--compute", f"{args.compute!r}: write real, emulated:DEVICE or emulated:PROFILE.json")
        try:
            compute_model(args.compute.removeprefix("emulated:"))
        except EmulationError as e:
            raise InputError("--compute", str(e)) from None
    from runtime.sim.simulate import UnknownStrategyError, schedule_for

    args.strategies = comma_list("--strategies", args.strategies)
    for s in args.strategies:
        try:
            schedule_for(s)
        except UnknownStrategyError as exc:
            raise InputError("--strategies", str(exc)) from None
    args.nodes = int_list("--nodes", args.nodes, 1)
    args.bandwidth = [link_rate("--bandwidth", b) for b in comma_list("--bandwidth", args.bandwidth)]
    args.intra_bandwidth = link_rate("--intra-bandwidth", args.intra_bandwidth)
    if args.compute_scale is not None:
        raise InputError("--compute-scale", "projection takes --compute-speedup N (compute N times as fast as "
                                            "profiled); --compute-scale N is emulated compute N times slower "
                                            "(--validate, train, the benchmarks)")
    at_least(args, 1, "ranks_per_node", "oversubscription", "batch_size", "ranks")
    at_least(args, 0, "latency", "send_buffer")
    positive_finite(args, "compute_speedup", "cores_per_host")
    fraction(args, "density")
    if args.take_profile and not args.out:
        raise InputError("--out", "--take-profile writes the profile to --out PATH")
    for opt in ("profile", "calibration"):
        path = getattr(args, opt)
        if path and not os.path.isfile(path):
            raise InputError(f"--{opt}", f"no such file: {path}")
    bench_outputs(args)


def default_profile(model: str, batch_size: int) -> str:
    """The profile of `model` on one rank of this machine, taken once and kept in CACHE."""
    path = os.path.join(CACHE, f"{model}-b{batch_size}-r1.json")
    if not os.path.exists(path):
        print(f"# no --profile: profiling {model} (batch {batch_size}) on one rank here, once -> {path}", flush=True)
        take_profile(model, 1, path, batch_size)
    return path


def modelled(args):
    """The compute model's profile of --model at --batch-size (runtime.emulate.sim_profile)."""
    from runtime.emulate.sim_profile import modelled_profile
    from runtime.workloads.models import build_model, model_input

    inputs, _ = model_input(args.model, args.batch_size)
    return modelled_profile(build_model(args.model), args.compute.removeprefix("emulated:"), inputs, args.model)


def describe_compute(args, profile) -> dict:
    """The compute every row, the table's header and the figure name: a device model's or a measured profile's,
    and the speed-up applied to it (a projection's figures are only as good as the compute it assumed)."""
    if args.compute != "real":
        from runtime.emulate import compute_model

        spec = args.compute.removeprefix("emulated:")
        cm = compute_model(spec)
        d = dict(compute="emulated", compute_spec=spec, compute_device=cm.device_name, compute_profile=None)
        label = f"emulated compute: {cm.label}"
    else:
        d = dict(compute="measured", compute_spec=None, compute_device=profile.device,
                 compute_profile=args.profile or "taken here")
        label = f"measured profile: {profile.device}, {profile.machine or 'machine unknown'}"
    if args.compute_speedup != 1:
        label += f", compute x{args.compute_speedup:g} as fast"
    return dict(d, compute_speedup=args.compute_speedup, compute_label=label)


def cluster_for(args, nodes: int, bandwidth: float, profile, cal: dict):
    """The projected cluster; `cal`: the calibration's transport figures ({} without --calibration)."""
    from runtime.sim import Cluster

    rpn = args.ranks_per_node
    return Cluster(nodes=nodes, ranks_per_node=rpn, bandwidth=bandwidth, latency=cal.get("latency", args.latency),
                   intra_bandwidth=args.intra_bandwidth, oversubscription=args.oversubscription,
                   efficiency=cal.get("efficiency", 0.94), transport_rate=cal.get("rate", float("inf")),
                   cpu_per_byte=cal.get("cpu_per_byte", 0.0), send_buffer=args.send_buffer,
                   cores_per_host=args.cores_per_host or 2.0 * rpn * profile.threads,
                   device="gpu" if profile.device == "cuda" else "cpu")


def project(args, profile, compute: dict) -> tuple[list[dict], list[str]]:
    """(rows, skipped): every strategy x bandwidth x node count that fits, one row each with the compute's fields;
    a line for each that does not."""
    import json

    from runtime.sim import simulate

    cal = {}
    if args.calibration:
        with open(args.calibration) as f:
            cal = json.load(f)["transport"]
    rows, skipped = [], []
    for bw in args.bandwidth:
        for nodes in args.nodes:
            cluster = cluster_for(args, nodes, bw, profile, cal)
            for s in args.strategies:
                t = time.perf_counter()
                opts = {"density": args.density} if "topk" in s else {}
                try:
                    r = simulate(profile, cluster, s, **opts)
                except ValueError as exc:  # a pipeline that does not fit this many ranks
                    skipped.append(f"{s} skipped on {nodes} node(s): {exc}")
                    continue
                rows.append(dict(model=profile.model, strategy=s, bandwidth_bps=bw, nodes=nodes,
                                 ranks_per_node=args.ranks_per_node, ranks=cluster.ranks, t_iter_s=r.t_iter_s,
                                 samples_per_s=r.samples_per_s, sim_seconds=time.perf_counter() - t,
                                 events=r.events, **compute,
                                 **{k: v for k, v in r.details.items() if k in ("p3", "plan")}))
    base = {}
    for r in rows:  # speed-up and efficiency against the same strategy on the fewest nodes
        key = (r["strategy"], r["bandwidth_bps"])
        b = base.setdefault(key, r)
        r["speedup"] = r["samples_per_s"] / b["samples_per_s"]
        r["efficiency"] = r["speedup"] / (r["ranks"] / b["ranks"])
    return rows, skipped


def markdown(rows) -> str:
    lines = ["| model | strategy | Gbit/s | nodes | ranks | T_iter s | samples/s | speed-up | efficiency |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['strategy']} | {r['bandwidth_bps'] / 1e9:g} | {r['nodes']} | {r['ranks']} | "
                     f"{r['t_iter_s']:.4f} | {r['samples_per_s']:.0f} | {r['speedup']:.2f} | {r['efficiency']:.2f} |")
    return "\n".join(lines)


def plot(rows, path: str, compute_label: str) -> None:
    from jobs.common.report import save_figure

    save_figure(figure(rows, compute_label), path)


def figure(rows, compute_label: str):
    """A panel per bandwidth: samples/s against nodes, one line per strategy, linear scaling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    bws = sorted({r["bandwidth_bps"] for r in rows})
    fig, axes = plt.subplots(1, len(bws), figsize=(5 * len(bws), 4), squeeze=False)
    for ax, bw in zip(axes[0], bws):
        mine = [r for r in rows if r["bandwidth_bps"] == bw]
        for s in dict.fromkeys(r["strategy"] for r in mine):
            pts = [r for r in mine if r["strategy"] == s]
            ax.plot([r["nodes"] for r in pts], [r["samples_per_s"] for r in pts], marker="o", label=s)
        first = min(mine, key=lambda r: r["nodes"])
        best = max((r for r in mine if r["nodes"] == first["nodes"]), key=lambda r: r["samples_per_s"])
        xs = sorted({r["nodes"] for r in mine})
        ax.plot(xs, [best["samples_per_s"] * n / first["nodes"] for n in xs], "k--", lw=0.8, label="linear")
        ax.set(xscale="log", yscale="log", xlabel="nodes", ylabel="samples/s", title=f"{mine[0]['model']}, {bw / 1e9:g} Gbit/s")
        # The node counts themselves as ticks: a log axis would label 2 as "2x10^0" and the rest not at all.
        ax.xaxis.set_major_locator(FixedLocator(xs))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.legend(fontsize=7)
    fig.suptitle(compute_label, fontsize=9)
    return fig


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "--validate" in argv:
        from jobs.sim import validate as sim_validate

        return sim_validate.main([a for a in argv if a != "--validate"])
    if "--papers" in argv:
        from jobs.sim import papers

        return papers.main([a for a in argv if a != "--papers"])
    args = parse_args(argv)
    if args.take_profile:
        row = take_profile(args.model, args.ranks, args.out, args.batch_size, args.timeout, args.device)
        print(f"profile of {args.model} on {args.ranks} rank(s): step {row['step_s']:.4f} s -> {args.out}")
        return 0
    from jobs.common.report import run_metadata, write_json
    from runtime.sim import Profile, ProfileError

    try:
        profile = modelled(args) if args.compute != "real" else \
            Profile.load(args.profile or default_profile(args.model, args.batch_size))
        if args.compute_speedup != 1:
            profile = profile.scaled(args.compute_speedup)
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    compute = describe_compute(args, profile)
    t = time.perf_counter()
    rows, skipped = project(args, profile, compute)
    took = time.perf_counter() - t
    if not rows:  # every row skipped: no table, speed-up or figure to make; one line, the first reason
        print(f"error: --strategies: no strategy fits these --nodes/--ranks-per-node ({skipped[0]})",
              file=sys.stderr)
        return 2
    for line in skipped:
        print(f"# {line}", file=sys.stderr)
    print(f"profile: {profile.model}, batch {profile.batch_size}, {profile.device}, step {profile.compute_s:.4f} s "
          f"(x{args.compute_speedup:g} as fast); {profile.machine}\n{compute['compute_label']}")
    print(markdown(rows))
    print(f"\n{len(rows)} simulations in {took:.2f} s (slowest {max(r['sim_seconds'] for r in rows):.3f} s)")
    if args.json:
        write_json(args.json, run_metadata("jobs.simulate", argv, seconds=took, profile=profile.to_json(), **compute),
                   rows)
    if args.plot:
        plot(rows, args.plot, compute["compute_label"])
    return 0


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
