"""P3's sweep across link rates (issue 27, target 1): p3 over the best other contender and over allreduce, per rate.

Reads `mpitrain bench strategies` JSONs (each one model across --bandwidths), prints a markdown table per model,
and writes a summary JSON and a PNG of the two ratios against the link rate, with the simulator's (runtime.sim fed
the same device model as the run, on the emulated cluster's calibration) beside the measured ones.

    python benchmarks/claims/p3_sweep.py OUT.json A.json [B.json ...] [--calibration CAL.json]
"""

from __future__ import annotations

import argparse
import json

from mpicomm.emulation import parse_bandwidth

OTHERS = ("allreduce", "wfbp", "ddp")


def ratio_ci(num: dict, den: dict) -> tuple[float, float]:
    """A conservative interval of num / den in samples/s: the ends of the two medians' CIs crossed."""
    (a0, a1), (b0, b1) = num["samples_per_s_ci"], den["samples_per_s_ci"]
    return a0 / b1, a1 / b0


def summarise(rows: list[dict], simulated: dict | None = None) -> list[dict]:
    """One entry per (model, bandwidth): each contender's samples/s and T_iter, p3 / best other, p3 / allreduce."""
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["bandwidth"]), {})[r["strategy"]] = r
    out = []
    for (model, bw), s in sorted(by.items(), key=lambda kv: (kv[0][0], parse_bandwidth(kv[0][1]))):
        if "p3" not in s or not all(o in s for o in OTHERS):
            continue
        best = max(OTHERS, key=lambda o: s[o]["samples_per_s"])
        p3 = s["p3"]
        e = dict(model=model, bandwidth=bw, gbits=parse_bandwidth(bw) / 1e9, t_compute_s=s["compute"]["t_iter_s"]
                 if "compute" in s else p3.get("t_compute_s"), best_other=best,
                 p3_over_best=p3["samples_per_s"] / s[best]["samples_per_s"],
                 p3_over_best_ci=ratio_ci(p3, s[best]),
                 p3_over_allreduce=p3["samples_per_s"] / s["allreduce"]["samples_per_s"],
                 p3_over_allreduce_ci=ratio_ci(p3, s["allreduce"]),
                 allreduce_t_comm_s=s["allreduce"].get("t_comm_s"),
                 overlap_efficiency=p3.get("overlap_efficiency"),
                 contenders={k: dict(samples_per_s=v["samples_per_s"], samples_per_s_ci=v["samples_per_s_ci"],
                                     t_iter_s=v["t_iter_s"], t_iter_rounds_s=v.get("t_iter_rounds_s"))
                             for k, v in s.items()})
        if simulated:
            sim = {k: simulated.get((model, bw, k)) for k in ("p3", *OTHERS)}
            if all(sim.values()):
                e["simulated_t_iter_s"] = sim
                e["simulated_p3_over_best"] = min(sim[o] for o in OTHERS) / sim["p3"]
                e["simulated_p3_over_allreduce"] = sim["allreduce"] / sim["p3"]
        out.append(e)
    return out


def simulate_rows(rows: list[dict], calibration: str) -> dict:
    """{(model, bandwidth, strategy): simulated T_iter s} from jobs.sim.validate's comparison of these rows."""
    from jobs.sim.validate import compare

    with open(calibration) as f:
        cal = json.load(f)
    return {(r["model"], r["bandwidth"], r["strategy"]): r["simulated_s"] for r in compare(rows, {}, cal)}


def markdown(entries: list[dict]) -> str:
    lines = []
    for model in dict.fromkeys(e["model"] for e in entries):
        lines += [f"\n{model}\n", "| link | T_compute s | allreduce | wfbp | p3 | DDP | p3 ÷ best other (CI) | "
                  "p3 ÷ allreduce (CI) | simulated: p3 ÷ best, ÷ allreduce |", "|---|---:|---:|---:|---:|---:|---|---|---|"]
        for e in (e for e in entries if e["model"] == model):
            c = e["contenders"]
            sps = " | ".join(f"{c[k]['samples_per_s']:.1f}" for k in ("allreduce", "wfbp", "p3", "ddp"))
            sim = (f"{e['simulated_p3_over_best']:.2f}, {e['simulated_p3_over_allreduce']:.2f}"
                   if "simulated_p3_over_best" in e else "")
            lines.append(f"| {e['bandwidth']} | {e['t_compute_s']:.3f} | {sps} | **{e['p3_over_best']:.2f}** "
                         f"({e['p3_over_best_ci'][0]:.2f}–{e['p3_over_best_ci'][1]:.2f}, {e['best_other']}) | "
                         f"{e['p3_over_allreduce']:.2f} ({e['p3_over_allreduce_ci'][0]:.2f}–"
                         f"{e['p3_over_allreduce_ci'][1]:.2f}) | {sim} |")
    return "\n".join(lines)


def plot(entries: list[dict], path: str, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for model in dict.fromkeys(e["model"] for e in entries):
        es = [e for e in entries if e["model"] == model]
        x = [e["gbits"] for e in es]
        for ax, key in zip(axes, ("p3_over_allreduce", "p3_over_best")):
            line, = ax.plot(x, [e[key] for e in es], "o-", label=f"{model} measured")
            lo, hi = zip(*(e[key + "_ci"] for e in es))
            ax.fill_between(x, lo, hi, alpha=0.15, color=line.get_color())
            sim = [e.get("simulated_" + key) for e in es]
            if all(v is not None for v in sim):
                ax.plot(x, sim, "x--", color=line.get_color(), label=f"{model} simulated")
    axes[0].set_title("p3 ÷ allreduce (samples/s)")
    axes[1].set_title("p3 ÷ best of allreduce, wfbp, DDP")
    axes[1].axhline(0.97, color="grey", lw=0.8, ls=":")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("link rate, Gbit/s")
        ax.legend(fontsize=7)
    fig.suptitle(label, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--calibration", help="jobs.sim.validate calibration JSON: add the simulator's ratios")
    args = ap.parse_args(argv)
    rows, metas = [], []
    for path in args.inputs:
        with open(path) as f:
            d = json.load(f)
        rows += d["rows"]
        metas.append(dict(path=path, command=d["meta"].get("command"), date=d["meta"].get("date"),
                          compute=d["meta"].get("compute_label"), carried=d["meta"].get("carried")))
    simulated = simulate_rows(rows, args.calibration) if args.calibration else None
    entries = summarise(rows, simulated)
    print(markdown(entries))
    with open(args.out, "w") as f:
        json.dump(dict(inputs=metas, entries=entries), f, indent=1)
    plot(entries, args.out.removesuffix(".json") + ".png", metas[0]["compute"] or "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
