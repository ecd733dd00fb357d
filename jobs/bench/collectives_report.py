"""jobs.bench.collectives' report: the table, the plot, the crossovers and the allreduce choice per size."""

from __future__ import annotations

import statistics

from jobs.common.report import save_figure
from jobs.common.stats import median_ci

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast")
CHOOSE_AMONG = {"ring-only": "ring", "doubling": "doubling", "rabenseifner": "rabenseifner",
                "hierarchical": "hierarchical"}
# Line styles of the impls the plot knows; any other impl a row names gets DEFAULT_STYLE (a fixed list dropped
# hierarchical-messages and -window from the PNG while the table had them).
STYLES = {"ring": "o-", "ring-only": "x-.", "native": "s--", "gloo": "^:", "doubling": "v-", "rabenseifner": "<-",
          "hierarchical": "D-", "hierarchical-messages": "d-.", "hierarchical-window": "P--", "auto": "*:"}
DEFAULT_STYLE = ".-"
IMPL_WIDTH = 23  # the longest impl name, hierarchical-messages, and two spaces
WITHIN = 1.05  # auto's bar: within 5 % of the fastest algorithm


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
    head = (f"{'op':<15}{'impl':<{IMPL_WIDTH}}{'bytes':>12}{'ranks':>6}{'time_ms':>11}{'algbw_GB/s':>12}"
            f"{'busbw_GB/s':>12}{'x bound':>9}  path")
    lines = [head, "-" * len(head)]
    lines += [f"{r['op']:<15}{r['impl']:<{IMPL_WIDTH}}{r['bytes']:>12}{r['ranks']:>6}{r['time_s'] * 1e3:>11.3f}"
              f"{r['algbw_gbps']:>12.3f}{r['busbw_gbps']:>12.3f}"
              f"{(format(r['time_s'] / r['bound_s'], '9.2f') if r.get('bound_s') else ''):>9}"
              f"{('  ' + r['path']) if r.get('path') else ''}{('/' + r['across']) if r.get('across') else ''}"
              for r in rows]
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows}, key=OPS.index)
    # At least 7 inches: the title's machine line must fit above a single op's plot.
    fig, axes = plt.subplots(1, len(ops), figsize=(max(7.0, 4.2 * len(ops)), 3.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        impls = list(dict.fromkeys(r["impl"] for r in rows if r["op"] == op))  # every one, in the rows' order
        for impl in impls:
            style = STYLES.get(impl, DEFAULT_STYLE)
            pts = sorted((r["bytes"], r["busbw_gbps"]) for r in rows if r["op"] == op and r["impl"] == impl)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=8)
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


def auto_against_fastest(rows) -> dict:
    """{bytes: judgement} at each allreduce size auto ran, against the fastest algorithm's row (least median).

    Two readings, each the median of ratios paired by round (both rows ran in
    the same round, under the same load: the pairing takes drift out) with its
    order-statistic CI: `auto`, auto's own row over the fastest's; `choice`,
    the row of the algorithm auto took over the fastest's (1 where it took the
    fastest: the regret of the choice alone, without a second measurement of
    the same code). `within` is "yes" where the whole CI is at most WITHIN,
    "no" where all of it is above, else "undecided".
    """
    by = {(r["bytes"], r["impl"]): r for r in rows if r["op"] == "allreduce"}
    out = {}
    for b in sorted(b for b, i in by if i == "auto"):
        algs = {CHOOSE_AMONG[i]: by[(b, i)] for i in CHOOSE_AMONG if (b, i) in by}
        if not algs:
            continue
        fastest = min(algs, key=lambda a: algs[a]["time_s"])
        auto, took = by[(b, "auto")], by[(b, "auto")].get("path")
        out[b] = dict(fastest=fastest, auto_took=took, ratio_of_medians=auto["time_s"] / algs[fastest]["time_s"],
                      auto=_paired(auto, algs[fastest]))
        if took in algs:
            out[b]["choice"] = _paired(algs[took], algs[fastest])
    return out


def _paired(row, best) -> dict:
    ratios = [a / f for a, f in zip(row["round_times_s"], best["round_times_s"])]
    low, high, coverage = median_ci(ratios)
    within = "yes" if high <= WITHIN else "no" if low > WITHIN else "undecided"
    return dict(median=statistics.median(ratios), ci=[low, high], coverage=coverage, within=within)


def choice_summary(rows, chosen, against: dict, say) -> None:
    """The fastest algorithm at each size, and auto's time over it (what auto is judged by)."""
    by = {(r["bytes"], r["impl"]): r["time_s"] for r in rows if r["op"] == "allreduce"}
    say("\nallreduce: the fastest algorithm per size" + (
        f"; auto's row over it, and its choice's row over it (paired by round: median, CI; within "
        f"{100 * (WITHIN - 1):g} %?)" if against else ":"))
    for b in sorted({b for b, _ in by}):
        times = {CHOOSE_AMONG[i]: by[(b, i)] for i in CHOOSE_AMONG if (b, i) in by}
        if not times:
            continue
        fastest = min(times, key=times.get)
        j = against.get(b)
        say(f"  {b:>12}  {fastest:<13}" + (f"  auto took {j['auto_took']:<13} auto {_text(j['auto'])}" + (
            f"   choice {_text(j['choice'])}" if "choice" in j else "") if j else ""))
    say(f"  table: {chosen}")


def _text(p: dict) -> str:
    return f"{p['median']:.2f} ({p['ci'][0]:.2f}-{p['ci'][1]:.2f}, {100 * p['coverage']:.3g} %) {p['within']:<9}"


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
