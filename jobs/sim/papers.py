r"""The four papers' headline setups, simulated on their GPUs' device models: their figures beside ours.

    mpitrain simulate --papers --json benchmarks/claims/papers.json
    mpitrain simulate --papers --only poseidon,p3

Each paper's configuration as far as runtime.emulate.papers could read it (its GPU, nodes, links, models and
batches), run through runtime.sim with the compute of runtime.emulate's device model (the same seconds per
layer that an emulated run waits: runtime.emulate.sim_profile), and set against the figure the paper states:

  p3        4 machines x 1 P4000, ResNet-50 and VGG-19 at 224x224, batch 32, links 1-30 Gbit/s:
            p3 over the layer-wise baseline (wfbp: MXNet's KVStore pushes layer by layer as it does),
            the largest gain and the bandwidth it is at (paper: +26 % at 4 Gbit/s, +66 % at 15 Gbit/s);
  poseidon  Titan X (Maxwell), VGG19-22K at 224x224, batch 32, 8/16/32 machines at 10 and 40 GbE:
            hybcomm's speed-up over one machine (paper: 15.5x on 16 at 10 GbE; ~30x on 32);
  mstopk    16 nodes x 8 V100 at 25 Gbit/s, ResNet-50 and VGG-19, density 0.001: hier-topk over the dense
            allreduce and wfbp (paper: 25-40 % faster than the systems it compares with);
  spectrain 4 GPUs (1080 Ti stand-in) of one machine over PCIe 3.0 x16 (~10 GB/s each), the FC-heavy model and
            the char-LSTM: the best pipeline mode over the best data-parallel strategy (paper: up to 8.91x).

Prints one table per paper, writes JSON rows (and a PNG: ours against the paper's figure where it gives one).
"""

from __future__ import annotations

import argparse
import sys
import time

from jobs.common.inputs import InputError, JobParser, comma_list, output_file, parse

PAPERS = ("p3", "poseidon", "mstopk", "spectrain")
PCIE_BPS = 80e9  # PCIe 3.0 x16 as a link: ~10 GB/s of payload each way


def parse_args(argv=None):
    p = JobParser(prog="mpitrain simulate --papers", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--only", default=",".join(PAPERS), help=f"default {','.join(PAPERS)}")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG", help="default: the JSON path with .png")
    return parse(p, argv, check_args)


def check_args(args) -> None:
    args.only = comma_list("--only", args.only)
    bad = [x for x in args.only if x not in PAPERS]
    if bad:
        raise InputError("--only", f"unknown paper {bad[0]!r} (have {', '.join(PAPERS)})")
    if args.plot is None and args.json:
        args.plot = args.json.removesuffix(".json") + ".png"
    output_file(args, "json", "plot")


_PROFILES: dict = {}


def profile(model: str, dev: str, batch: int | None = None):
    from runtime.emulate.sim_profile import modelled_profile
    from runtime.workloads.models import PAPER_BATCH, build_model, model_input

    batch = batch or PAPER_BATCH.get(model, 32)
    key = (model, dev, batch)
    if key not in _PROFILES:
        inputs, _ = model_input(model, batch)
        _PROFILES[key] = modelled_profile(build_model(model), dev, inputs, model)
    return _PROFILES[key]


def t_iter(prof, strategy: str, nodes: int, bps: float, rpn: int = 1, **opts) -> float:
    from runtime.sim import Cluster, simulate

    cluster = Cluster(nodes=nodes, ranks_per_node=rpn, bandwidth=bps, cores_per_host=2.0 * rpn, device="gpu")
    return simulate(prof, cluster, strategy, **opts).t_iter_s


def row(paper, model, dev, config, metric, ours, claimed=None, at=None, **extra) -> dict:
    return dict(paper=paper, model=model, device=dev, config=config, metric=metric, ours=ours, paper_figure=claimed,
                at=at, **extra)


def p3() -> list[dict]:
    out = []
    for model, claimed, claimed_at in (("resnet50-224", 1.26, 4), ("vgg19-224", 1.66, 15)):
        prof = profile(model, "p4000")
        gains = {}
        for g in (1, 2, 4, 6, 8, 10, 15, 20, 30):
            ts = {s: t_iter(prof, s, 4, g * 1e9) for s in ("wfbp", "p3", "allreduce")}
            gains[g] = ts["wfbp"] / ts["p3"]
            out.append(row("p3", model, "p4000", f"4 x 1, {g} Gbit/s", "p3 / wfbp (throughput)", gains[g],
                           at=g, p3_over_allreduce=ts["allreduce"] / ts["p3"], t_iter_s=ts))
        best = max(gains, key=gains.get)
        out.append(row("p3", model, "p4000", f"4 x 1, best of 1-30 Gbit/s (at {best})", "largest p3 / wfbp",
                       gains[best], claimed, claimed_at, ours_at=best))
    return out


def poseidon() -> list[dict]:
    out = []
    prof = profile("vgg19-22k-224", "titanx")
    one = t_iter(prof, "compute", 1, 10e9)
    for gbit in (10, 40):
        for nodes in (8, 16, 32):
            for s in ("hybcomm", "wfbp"):
                speedup = nodes * one / t_iter(prof, s, nodes, gbit * 1e9)
                claimed = {(10, 16): 15.5, (10, 32): 30.0}.get((gbit, nodes)) if s == "hybcomm" else None
                out.append(row("poseidon", "vgg19-22k-224", "titanx", f"{nodes} x 1, {gbit} GbE", f"{s} speed-up",
                               speedup, claimed, nodes))
    return out


def mstopk() -> list[dict]:
    out = []
    for model in ("resnet50-224", "vgg19-224"):
        prof = profile(model, "v100")
        ts = {s: t_iter(prof, s, 16, 25e9, rpn=8, **({"density": 1e-3} if "topk" in s else {}))
              for s in ("allreduce", "wfbp", "topk", "hier-topk")}
        for base in ("allreduce", "wfbp", "topk"):
            out.append(row("mstopk", model, "v100", "16 x 8, 25 Gbit/s, density 0.001", f"hier-topk / {base}",
                           ts[base] / ts["hier-topk"], (1.25, 1.40) if base == "allreduce" else None, t_iter_s=ts))
    return out


def spectrain() -> list[dict]:
    from runtime.sim import Cluster, simulate

    out = []
    cluster = Cluster(nodes=4, ranks_per_node=1, bandwidth=PCIE_BPS, cores_per_host=2.0, device="gpu")
    for model in ("fc-heavy", "char-lstm"):
        prof = profile(model, "1080ti")
        rates = {}
        for s in ("allreduce", "wfbp", "pipeline-flush", "pipeline-vanilla", "pipeline-stash", "pipeline-spectrain"):
            try:
                rates[s] = simulate(prof, cluster, s).samples_per_s
            except ValueError as exc:  # a pipeline that does not fit
                print(f"# spectrain {model} {s} skipped: {exc}", file=sys.stderr)
        dp = max((rates[s], s) for s in ("allreduce", "wfbp") if s in rates)
        pipe = max((rates[s], s) for s in rates if s.startswith("pipeline-"))
        out.append(row("spectrain", model, "1080ti", "4 GPUs of one machine, PCIe 3.0 x16",
                       f"best pipeline ({pipe[1]}) / best data parallel ({dp[1]})", pipe[0] / dp[0], 8.91,
                       samples_per_s=rates))
    return out


def markdown(rows) -> str:
    lines = ["| paper | model | device | configuration | measure | ours (simulated) | paper |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        claimed = r["paper_figure"]
        text = "" if claimed is None else (f"{claimed[0]:g}-{claimed[1]:g}" if isinstance(claimed, tuple)
                                           else f"{claimed:g}")
        lines.append(f"| {r['paper']} | {r['model']} | {r['device']} | {r['config']} | {r['metric']} | "
                     f"{r['ours']:.2f} | {text} |")
    return "\n".join(lines)


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jobs.common.report import save_figure

    pts = [r for r in rows if r["paper_figure"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['paper']}\n{r['model']}\n{r['config'][:18]}" for r in pts]
    claimed = [sum(r["paper_figure"]) / 2 if isinstance(r["paper_figure"], tuple) else r["paper_figure"] for r in pts]
    xs = range(len(pts))
    ax.bar([x - 0.2 for x in xs], claimed, 0.4, label="paper")
    ax.bar([x + 0.2 for x in xs], [r["ours"] for r in pts], 0.4, label="ours (simulated, device model)")
    ax.set_xticks(list(xs), labels, fontsize=6)
    ax.set(yscale="log", ylabel="ratio (speed-up or gain)", title="The papers' headline figures beside ours")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jobs.common.report import run_metadata, write_json

    t = time.perf_counter()
    rows = [r for name in args.only for r in globals()[name]()]
    print("simulated (runtime.sim) with each paper's GPU as runtime.emulate's device model; no run measured here")
    print(markdown(rows))
    print(f"\n{len(rows)} rows in {time.perf_counter() - t:.1f} s")
    if args.json:
        write_json(args.json, run_metadata("jobs.simulate", ["--papers", *(argv or sys.argv[1:])]), rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
