"""The simulator's validation, reported: the figure's title, the markdown table, the measured-against-simulated plot."""

from __future__ import annotations


def figure_title(rows) -> str:
    """The PNG's title: what it compares, under which compute (the rows' own), on which machine."""
    from jobs.common.report import machine, machine_line

    computes = ", ".join(dict.fromkeys((r["compute"] or "real") + (
        f" x{r['compute_scale']:g}" if r["compute_scale"] not in (None, 1) else "") for r in rows))
    return f"runtime.sim against the emulated cluster\ncompute: {computes}\n{machine_line(machine())}"


def markdown(rows) -> str:
    lines = ["| model | strategy | link | ranks | measured T_iter s | simulated s | error | comm cores/rank "
             "| without them s | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['strategy']} | {r['bandwidth']} | {r['ranks']} | {r['measured_s']:.3f} | "
                     f"{r['simulated_s']:.3f} | {100 * r['error']:+.1f} % | {r['comm_cores']:.2f} | "
                     f"{r['simulated_without_comm_cpu_s']:.3f} | {100 * r['error_without_comm_cpu']:+.1f} % |")
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jobs.common.report import save_figure

    fig, ax = plt.subplots(figsize=(6, 6))
    for s in dict.fromkeys(r["strategy"] for r in rows):
        pts = [r for r in rows if r["strategy"] == s]
        ax.scatter([r["measured_s"] for r in pts], [r["simulated_s"] for r in pts], label=s, s=18)
    lo = min(min(r["measured_s"], r["simulated_s"]) for r in rows) * 0.8
    hi = max(max(r["measured_s"], r["simulated_s"]) for r in rows) * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [0.9 * lo, 0.9 * hi], [1.1 * lo, 1.1 * hi], color="grey", alpha=0.2, label="±10 %")
    ax.set(xscale="log", yscale="log", xlabel="measured T_iter (s)", ylabel="simulated T_iter (s)")
    fig.suptitle(title, fontsize=8)
    ax.legend(fontsize=7)
    save_figure(fig, path)
