"""Benchmark: MSTopK against torch.topk, on one CPU thread or on a CUDA device.

    mpitrain bench mstopk --json results/mstopk.json --sizes 1M,25M --densities 0.001,0.01
    mpitrain bench mstopk --device cuda --json results/mstopk-cuda.json   # d = 1M, 25M, 100M

For each size d (elements, decimal K/M/G suffixes) and density, k = ceil(density * d)
of a seeded random vector; one row per implementation with d, density, k, impl,
median_s, min_s, max_s (over --repeats timed calls after one warm-up call),
speedup_vs_topk (torch.topk's median over this one's), count (elements returned),
exactly_k and mass_ratio (captured sum of squares over the exact top-k's). torch.topk is
timed as the reference selection, runtime.sparse.mstopk.exact_topk: |x|, topk unsorted,
gather of the signed values, i.e. the same output as MSTopK.

On CPU: MSTopK's NumPy search, sampled and plain bisection, one thread, each
call timed by perf_counter. With --device cuda: MSTopK on a CUDA tensor (its
DeviceMSTopK), each call timed by a pair of CUDA events and a synchronize; the
JSON names the GPU, its driver and torch. On both, the implementations' calls
are interleaved (repeat r of every one before repeat r+1 of any; on CPU the
order rotating each round) so that clocks and neighbours weigh on all alike.
--plot (or --png) draws the bars.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

from jobs.common.inputs import InputError, JobParser, at_least, check_fraction, comma_list, output_file, parse
from jobs.common.outputs import write_together
from jobs.common.report import parse_size, run_metadata, save_figure, write_json

IMPLS = ("mstopk-sampled", "mstopk-bisection", "torch.topk")  # the first is MSTopK's default
CUDA_IMPLS = ("mstopk", "torch.topk")
DEFAULT_SIZES = {"cpu": "1M,25M", "cuda": "1M,25M,100M"}


def parse_count(text: str) -> int:
    return parse_size(text, binary=False)


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.mstopk", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where x lives (default cpu)")
    p.add_argument("--sizes", help="comma-separated element counts (default 1M,25M; cuda: 1M,25M,100M)")
    p.add_argument("--densities", default="0.001,0.01", help="comma-separated k/d (default 0.001,0.01)")
    p.add_argument("--repeats", type=int, help="timed calls per row (default 5; cuda: 21)")
    p.add_argument("--data", default="normal", choices=("normal", "cubed"),
                   help="randn, or randn**3 for heavy tails (default normal)")
    p.add_argument("--iters", type=int, help="MSTopK probes (default: MSTopK's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the rows (and run metadata) here")
    p.add_argument("--plot", "--png", dest="plot", metavar="PNG",
                   help="bar plot (default: the JSON path with .png; --png: the same, its older name)")
    return parse(p, argv, check_args)


def check_args(args) -> None:
    args.sizes = comma_list("--sizes", args.sizes or DEFAULT_SIZES[args.device], parse=parse_count)
    args.densities = comma_list("--densities", args.densities, parse=float)
    for density in args.densities:
        check_fraction("--densities", density)
    at_least(args, 1, "repeats", "iters")
    args.repeats = args.repeats or (21 if args.device == "cuda" else 5)
    at_least(args, 0, "seed")
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "plot")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise InputError("--device", f"cuda, but torch {torch.__version__} sees no CUDA device")


def summary(times: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    times = sorted(times)
    mid = len(times) // 2
    median = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
    return median, times[0], times[-1]


def time_interleaved(fns: dict, repeats: int) -> dict:
    """{name: (median s, min s, max s, last result)}: perf_counter timings, one untimed warm-up call each, then
    round by round a call of every one, the order rotating, so that a slow moment of the machine (a neighbour, the
    clock) falls on every implementation alike rather than on whichever ran its repeats then."""
    names = list(fns)
    outs = {name: fns[name]() for name in names}
    times: dict = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            outs[name] = fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: (*summary(times[name]), outs[name]) for name in names}


def time_cuda_interleaved(fns: dict, repeats: int, torch) -> dict:
    """{name: (median s, min s, max s, last result)}: CUDA-event timings, the calls interleaved.

    Each call sits between two events on the current stream and is
    synchronised before the next starts, so a call's time is its own kernels'
    (and launches'), not a queue's; a warm-up call each first allocates buffers.
    """
    outs = {name: fn() for name, fn in fns.items()}
    torch.cuda.synchronize()
    times: dict = {name: [] for name in fns}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        for name, fn in fns.items():
            start.record()
            outs[name] = fn()
            stop.record()
            stop.synchronize()
            times[name].append(start.elapsed_time(stop) / 1e3)  # ms -> s
    return {name: (*summary(times[name]), outs[name]) for name in fns}


def cuda_metadata(torch) -> dict:
    """The GPU, its driver and torch's CUDA, for the JSON."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    meta = dict(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                compute_capability=f"{props.major}.{props.minor}", torch_cuda=torch.version.cuda, driver=None)
    try:  # nvidia-smi, where installed, is the one place that names the driver
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            meta["driver"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return meta


def format_table(rows) -> str:
    lines = ["| d | density | k | impl | median ms | min ms | max ms | speedup vs topk | count | mass ratio |",
             "|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['d']:,} | {r['density']:g} | {r['k']:,} | {r['impl']} | {r['median_s'] * 1e3:.3f} | "
              f"{r['min_s'] * 1e3:.3f} | {r['max_s'] * 1e3:.3f} | {r['speedup_vs_topk']:.2f}x | {r['count']:,} | "
              f"{r['mass_ratio']:.6f} |" for r in rows]
    return "\n".join(lines)


def plot(rows, path: str, title: str, impls=IMPLS) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["d"], r["density"]) for r in rows))
    by = {(r["d"], r["density"], r["impl"]): r for r in rows}
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(cases) + 1.5), 4.0))
    for j, impl in enumerate(impls):
        xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(cases))]
        ys = [by[c + (impl,)]["median_s"] * 1e3 for c in cases]
        bars = ax.bar(xs, ys, width, label=impl)
        for bar, c in zip(bars, cases):
            ax.annotate(f"{by[c + (impl,)]['speedup_vs_topk']:.1f}x", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(cases)), [f"d={d:,}\ndensity {p:g}" for d, p in cases], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("median time per call (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch  # here, not at import: runtime starts MPI

    from runtime.sparse.mstopk import DEFAULT_ITERS, MSTopK
    from runtime.sparse.selection import exact_topk, k_for_density

    args.iters = args.iters or DEFAULT_ITERS
    cuda = args.device == "cuda"
    impls = CUDA_IMPLS if cuda else IMPLS
    if cuda:
        ops = {"mstopk": MSTopK(seed=args.seed)}  # a CUDA tensor goes to its DeviceMSTopK
        where = f"{torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda})"
    else:
        torch.set_num_threads(1)  # the operator's home is one rank per core, beside the training
        ops = {"mstopk-sampled": MSTopK(args.iters, sampled=True, seed=args.seed),
               "mstopk-bisection": MSTopK(args.iters, sampled=False, seed=args.seed)}
        where = f"one thread, torch {torch.__version__}, MSTopK iters {args.iters}"
    rows = []
    print(f"# {where}, data {args.data}, {args.repeats} timed calls per row after a warm-up, interleaved"
          + (", CUDA events" if cuda else ", perf_counter"))
    print(format_table([]), flush=True)
    for d in args.sizes:
        gen = torch.Generator(device=args.device).manual_seed(args.seed)
        x = torch.randn(d, generator=gen, device=args.device)
        if args.data == "cubed":
            x.pow_(3)
        for density in args.densities:
            k = k_for_density(d, density)
            fns = {impl: (lambda x=x, k=k: exact_topk(x, k)) if impl == "torch.topk"
                   else (lambda op=ops[impl], x=x, k=k: op(x, k)) for impl in impls}
            if cuda:
                timed = time_cuda_interleaved(fns, args.repeats, torch)
            else:
                timed = time_interleaved(fns, args.repeats)
            case = []
            for impl in impls:
                median, best, worst, (values, indices) = timed[impl]
                exactly = values.numel() == k and torch.unique(indices).numel() == k
                case.append(dict(d=d, density=density, k=k, impl=impl, median_s=median, min_s=best, max_s=worst,
                                 count=values.numel(), exactly_k=bool(exactly),
                                 mass=float((values.double() ** 2).sum())))
            ref_s, ref_mass = case[-1]["median_s"], case[-1]["mass"]  # torch.topk's
            for r in case:
                r["speedup_vs_topk"] = ref_s / r["median_s"]
                r["mass_ratio"] = r.pop("mass") / ref_mass if ref_mass > 0 else 1.0
            rows += case
            print("\n".join(format_table(case).splitlines()[2:]), flush=True)
        for op in ops.values():
            op.clear_cache()  # one size's buffers at a time
        del x, fns
    extra = dict(torch=torch.__version__, data=args.data, repeats=args.repeats, seed=args.seed,
                 default_impl=impls[0], target=args.device)
    if cuda:
        extra.update(cuda_metadata(torch), timing="cuda events, interleaved", passes=ops["mstopk"].device_op.passes)
    else:
        extra.update(threads=1, iters=args.iters, timing="perf_counter, interleaved round by round")
    meta = run_metadata("jobs.bench.mstopk", argv, **extra)
    if args.json:
        write_together(None, "--json", args.json, lambda: write_json(args.json, meta, rows))
    if args.plot:
        title = (f"top-k of |x| on {meta['device']}" if cuda else "top-k of |x|, one thread") + \
            f", {args.data} data\n(labels: speedup vs torch.topk)"
        write_together(None, "--plot", args.plot,
                       lambda: (plot(rows, args.plot, title, impls), print(f"wrote {args.plot}")))
    return 0


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
