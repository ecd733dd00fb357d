"""jobs.bench.collectives' report: the table, the plot, the crossovers and the allreduce choice per size."""

from __future__ import annotations

from jobs.common.report import save_figure

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast")
CHOOSE_AMONG = {"ring-only": "ring", "doubling": "doubling", "rabenseifner": "rabenseifner",
                "hierarchical": "hierarchical"}


def crossover(rows, op: str) -> int | None:
    """Smallest size from which ring-only's busbw beats native's at every larger size measured.

    None when the ring never wins at the largest size. A suffix, not the first
    win: on a noisy machine one lucky small size must not send everything
    above it to the ring.
    """
    by = {(r["bytes"], r["impl"]): r["busbw_gbps"] for r in rows if r["op"] == op}
    sizes = sorted({b for b, impl in by if impl == "ring-only" and (b, "native") in by})
    best = None
    for b in reversed(sizes):
        if by[(b, "ring-only")] <= by[(b, "native")]:
            break
        best = b
    return best


def format_table(rows) -> str:
    head = (f"{'op':<15}{'impl':<10}{'bytes':>12}{'ranks':>6}{'time_ms':>11}{'algbw_GB/s':>12}{'busbw_GB/s':>12}"
            f"{'x bound':>9}  path")
    lines = [head, "-" * len(head)]
    lines += [f"{r['op']:<15}{r['impl']:<10}{r['bytes']:>12}{r['ranks']:>6}{r['time_s'] * 1e3:>11.3f}"
              f"{r['algbw_gbps']:>12.3f}{r['busbw_gbps']:>12.3f}"
              f"{(format(r['time_s'] / r['bound_s'], '9.2f') if r.get('bound_s') else ''):>9}"
              f"{('  ' + r['path']) if r.get('path') else ''}" for r in rows]
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows}, key=OPS.index)
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for impl, style in (("ring", "o-"), ("ring-only", "x-."), ("native", "s--"), ("gloo", "^:"),
                            ("doubling", "v-"), ("rabenseifner", "<-"), ("hierarchical", "D-"), ("auto", "*:")):
            pts = sorted((r["bytes"], r["busbw_gbps"]) for r in rows if r["op"] == op and r["impl"] == impl)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    save_figure(fig, path)


def choose(rows) -> list:
    """[[below_bytes, algorithm], ..., [None, algorithm]]: the fastest algorithm from each size measured up."""
    best = {}
    for r in rows:
        if r["op"] == "allreduce" and r["impl"] in CHOOSE_AMONG:
            b = r["bytes"]
            if b not in best or r["time_s"] < best[b][0]:
                best[b] = (r["time_s"], CHOOSE_AMONG[r["impl"]])
    sizes = sorted(best)
    table = []
    for i, b in enumerate(sizes):
        name = best[b][1]
        upper = sizes[i + 1] if i + 1 < len(sizes) else None
        if table and table[-1][1] == name:
            table[-1][0] = upper
        else:
            table.append([upper, name])
    return table


def choice_summary(rows, chosen, say) -> None:
    """auto's time over the fastest algorithm's at each size (what auto is judged by)."""
    by = {(r["bytes"], r["impl"]): r["time_s"] for r in rows if r["op"] == "allreduce"}
    say("\nallreduce: the fastest algorithm per size" + (", and auto's time over it:" if any(
        i == "auto" for _, i in by) else ":"))
    for b in sorted({b for b, _ in by}):
        times = {CHOOSE_AMONG[i]: by[(b, i)] for i in CHOOSE_AMONG if (b, i) in by}
        if not times:
            continue
        fastest = min(times, key=times.get)
        auto = by.get((b, "auto"))
        say(f"  {b:>12}  {fastest:<13}" + (f"  auto {auto / times[fastest]:5.2f}x" if auto else ""))
    say(f"  table: {chosen}")


def summary(rows, measured: dict, sizes, say) -> None:
    """Each ring impl's busbw over native's per op and size, then the measured crossovers."""
    by = {(r["op"], r["bytes"], r["impl"]): r for r in rows}
    for impl in ("ring", "ring-only"):
        pairs = [(op, b) for (op, b, i) in by if i == impl and (op, b, "native") in by]
        if pairs:
            say(f"\n{impl} / native busbw:")
            for op, b in pairs:
                n = by[(op, b, "native")]["busbw_gbps"]
                ratio = by[(op, b, impl)]["busbw_gbps"] / n if n else float("nan")
                path = by[(op, b, impl)].get("path")
                say(f"  {op:<15}{b:>12}  {ratio:5.2f}x" + (f"  ({path})" if path else ""))
    if measured:
        say("\ncrossover (ring-only beats native from this size on):")
        for op, b in measured.items():
            say(f"  {op:<15}" + (f"{b:>12}" if b is not None else f"  never up to {max(sizes)}"))
