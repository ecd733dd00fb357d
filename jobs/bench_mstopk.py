"""Benchmark: MSTopK (sampled and plain bisection) against torch.topk on one CPU thread.

    python -m jobs.bench_mstopk --json results/mstopk.json --sizes 1M,25M --densities 0.001,0.01

For each size d (elements, decimal K/M/G suffixes) and density, k = ceil(density * d)
of a seeded random vector; one row per implementation with d, density, k, impl,
median_s, min_s (over --repeats timed calls after one warm-up call),
speedup_vs_topk (torch.topk's median over this one's), count (elements returned)
and mass_ratio (captured sum of squares over the exact top-k's). torch.topk is
timed as the reference selection, runtime.sparse.mstopk.exact_topk: |x|, topk unsorted,
gather of the signed values, i.e. the same output as MSTopK.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jobs.inputs import JobParser, at_least, check_fraction, comma_list, output_file, parse
from jobs.outputs import write_together
from jobs.report import parse_size, run_metadata, save_figure, write_json

IMPLS = ("mstopk-sampled", "mstopk-bisection", "torch.topk")  # the first is MSTopK's default
def parse_count(text: str) -> int:
    return parse_size(text, binary=False)


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench_mstopk", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1M,25M", help="comma-separated element counts (default 1M,25M)")
    p.add_argument("--densities", default="0.001,0.01", help="comma-separated k/d (default 0.001,0.01)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per row (default 5)")
    p.add_argument("--data", default="normal", choices=("normal", "cubed"),
                   help="randn, or randn**3 for heavy tails (default normal)")
    p.add_argument("--iters", type=int, help="MSTopK probes (default: MSTopK's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the rows (and run metadata) here")
    p.add_argument("--png", metavar="PATH", help="bar plot (default: the JSON path with .png)")
    return parse(p, argv, check_args)


def check_args(args) -> None:
    args.sizes = comma_list("--sizes", args.sizes, parse=parse_count)
    args.densities = comma_list("--densities", args.densities, parse=float)
    for density in args.densities:
        check_fraction("--densities", density)
    at_least(args, 1, "repeats", "iters")
    at_least(args, 0, "seed")
    if args.png is None and args.json:
        args.png = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "png")


def time_calls(fn, repeats: int) -> tuple[float, float, tuple]:
    """(median s, min s, last result) over `repeats` calls after one untimed warm-up call."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    mid = len(times) // 2
    median = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
    return median, times[0], out


def format_table(rows) -> str:
    lines = ["| d | density | k | impl | median ms | min ms | speedup vs topk | count | mass ratio |",
             "|---:|---:|---:|:---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['d']:,} | {r['density']:g} | {r['k']:,} | {r['impl']} | {r['median_s'] * 1e3:.2f} | "
              f"{r['min_s'] * 1e3:.2f} | {r['speedup_vs_topk']:.2f}x | {r['count']:,} | {r['mass_ratio']:.6f} |"
              for r in rows]
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["d"], r["density"]) for r in rows))
    by = {(r["d"], r["density"], r["impl"]): r for r in rows}
    width = 0.8 / len(IMPLS)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(cases) + 1.5), 4.0))
    for j, impl in enumerate(IMPLS):
        xs = [i + (j - (len(IMPLS) - 1) / 2) * width for i in range(len(cases))]
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

    from runtime.sparse.mstopk import DEFAULT_ITERS, MSTopK, exact_topk, k_for_density

    args.iters = args.iters or DEFAULT_ITERS
    torch.set_num_threads(1)  # the operator's home is one rank per core, beside the training
    ops = {"mstopk-sampled": MSTopK(args.iters, sampled=True, seed=args.seed),
           "mstopk-bisection": MSTopK(args.iters, sampled=False, seed=args.seed)}
    rows = []
    print(f"# one thread, torch {torch.__version__}, data {args.data}, MSTopK iters {args.iters}, "
          f"{args.repeats} timed calls per row after a warm-up")
    print(format_table([]), flush=True)
    for d in args.sizes:
        x = torch.randn(d, generator=torch.Generator().manual_seed(args.seed))
        if args.data == "cubed":
            x.pow_(3)
        for density in args.densities:
            k = k_for_density(d, density)
            case = []
            for impl in IMPLS:
                fn = (lambda: exact_topk(x, k)) if impl == "torch.topk" else (lambda op=ops[impl]: op(x, k))
                median, best, (values, _) = time_calls(fn, args.repeats)
                case.append(dict(d=d, density=density, k=k, impl=impl, median_s=median, min_s=best,
                                 count=values.numel(), mass=float((values.double() ** 2).sum())))
            ref_s, ref_mass = case[-1]["median_s"], case[-1]["mass"]  # torch.topk's
            for r in case:
                r["speedup_vs_topk"] = ref_s / r["median_s"]
                r["mass_ratio"] = r.pop("mass") / ref_mass if ref_mass > 0 else 1.0
            rows += case
            print("\n".join(format_table(case).splitlines()[2:]), flush=True)
        ops["mstopk-sampled"].clear_cache()  # one size's buffers at a time
        ops["mstopk-bisection"].clear_cache()
        del x
    meta = run_metadata("jobs.bench_mstopk", argv, threads=1, torch=torch.__version__, data=args.data,
                        iters=args.iters, repeats=args.repeats, seed=args.seed, default_impl=IMPLS[0])
    if args.json:
        write_together(None, "--json", args.json, lambda: write_json(args.json, meta, rows))
    if args.png:
        title = f"top-k of |x|, one thread, {args.data} data\n(labels: speedup vs torch.topk)"
        write_together(None, "--png", args.png, lambda: (plot(rows, args.png, title), print(f"wrote {args.png}")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
