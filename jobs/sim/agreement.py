"""How far the simulator agrees with the measurement: T_iter errors, the strategies' order, speed-up ratios."""

from __future__ import annotations

import statistics

__all__ = ["RATIO_POINTS", "rankings", "speedups", "verdict", "verdict_lines"]

# Issue 27's targets: mean |error| <= 5 %, worst <= 10 %, each speed-up ratio within 3 points (0.03).
MEAN_ERROR, WORST_ERROR, RATIO_POINTS = 0.05, 0.10, 3.0


def _configurations(rows):
    """{(model, bandwidth, ranks): the rows of that configuration, compute left out}, in first-seen order."""
    out = {}
    for r in rows:
        if r["strategy"] != "compute":
            out.setdefault((r["model"], r["bandwidth"], r["ranks"]), []).append(r)
    return out


def rankings(rows) -> list[dict]:
    """Per configuration (model, link, ranks): whether the simulator orders the strategies as measured, and over
    the pairs that the measurement itself orders (every round of one faster than every round of the other), how
    many it orders the same way. A pair whose rounds interleave has no measured order to agree with."""
    out = []
    for key, rs in _configurations(rows).items():
        measured_order = [r["strategy"] for r in sorted(rs, key=lambda r: r["measured_s"])]
        simulated_order = [r["strategy"] for r in sorted(rs, key=lambda r: r["simulated_s"])]
        separated, swapped = 0, []
        for i, a in enumerate(rs):
            for b in rs[i + 1:]:
                ra, rb = a["measured_rounds_s"], b["measured_rounds_s"]
                if not (ra and rb) or not (max(ra) < min(rb) or max(rb) < min(ra)):
                    continue
                separated += 1
                if (a["measured_s"] < b["measured_s"]) != (a["simulated_s"] < b["simulated_s"]):
                    swapped.append(f"{a['strategy']}/{b['strategy']}")
        out.append(dict(model=key[0], bandwidth=key[1], ranks=key[2], same_order=measured_order == simulated_order,
                        pairs=len(rs) * (len(rs) - 1) // 2, separated=separated, swapped=swapped))
    return out


def speedups(rows, baseline: str = "allreduce") -> list[dict]:
    """Each strategy's speed-up over `baseline` in its configuration (T_iter of the baseline ÷ its own), measured
    and simulated, and the error in points (hundredths of the ratio). The measured ratio is also taken round by
    round (the rounds interleave the strategies, so round i of each ran side by side): the span of those ratios is
    what the measurement itself resolves, and `inside` says whether the simulated ratio lies within it. A
    configuration without the baseline gives no rows."""
    out = []
    for key, rs in _configurations(rows).items():
        base = next((r for r in rs if r["strategy"] == baseline), None)
        if base is None:
            continue
        for r in rs:
            if r is base:
                continue
            measured = base["measured_s"] / r["measured_s"]
            simulated = base["simulated_s"] / r["simulated_s"]
            rounds = [b / s for b, s in zip(base["measured_rounds_s"], r["measured_rounds_s"])]
            low, high = (min(rounds), max(rounds)) if rounds else (measured, measured)
            out.append(dict(model=key[0], bandwidth=key[1], ranks=key[2], strategy=r["strategy"], baseline=baseline,
                            measured=measured, simulated=simulated, error_points=100 * (simulated - measured),
                            measured_rounds=rounds, measured_span_points=100 * (high - low),
                            inside=low - 1e-12 <= simulated <= high + 1e-12 if len(rounds) > 1 else None))
    return out


def verdict(rows, ranked, sped) -> dict:
    """Issue 27 target 5's figures over the grid: mean and worst |error|, ratios within RATIO_POINTS, pairs kept."""
    errors = [abs(r["error"]) for r in rows if r["strategy"] != "compute"]
    worst = max((r for r in rows if r["strategy"] != "compute"), key=lambda r: abs(r["error"]), default=None)
    separated = sum(k["separated"] for k in ranked)
    kept = separated - sum(len(k["swapped"]) for k in ranked)
    return dict(rows=len(errors), mean_abs_error=statistics.fmean(errors) if errors else None,
                worst_error=worst["error"] if worst else None,
                worst=f"{worst['model']} {worst['strategy']} {worst['bandwidth']} {worst['ranks']} ranks" if worst else None,
                within_10=sum(e <= WORST_ERROR for e in errors),
                ratios=len(sped), ratios_within=sum(abs(s["error_points"]) <= RATIO_POINTS for s in sped),
                ratios_resolved=sum(s["measured_span_points"] <= RATIO_POINTS for s in sped if s["inside"] is not None),
                ratios_inside=sum(bool(s["inside"]) for s in sped),
                ratios_with_rounds=sum(s["inside"] is not None for s in sped),
                pairs_separated=separated, pairs_kept=kept, same_order=sum(k["same_order"] for k in ranked),
                configurations=len(ranked))


def verdict_lines(v: dict, sped) -> list[str]:
    """The verdict as printed: one line per figure, each against its target, then the ratios outside 3 points."""
    if not v["rows"]:
        return ["no strategy rows to judge"]

    def met(ok):
        return "met" if ok else "missed"

    lines = [f"mean |error| {100 * v['mean_abs_error']:.2f} % over {v['rows']} rows: "
             f"{met(v['mean_abs_error'] <= MEAN_ERROR)} (<= {100 * MEAN_ERROR:.0f} %)",
             f"worst {100 * v['worst_error']:+.1f} % ({v['worst']}); {v['within_10']} of {v['rows']} within "
             f"{100 * WORST_ERROR:.0f} %: {met(abs(v['worst_error']) <= WORST_ERROR)}",
             f"ordered pairs kept: {v['pairs_kept']} of the {v['pairs_separated']} the rounds order; same order in "
             f"{v['same_order']} of {v['configurations']} configurations: {met(v['pairs_kept'] == v['pairs_separated'])}"]
    if v["ratios"]:
        lines.append(f"speed-ups within {RATIO_POINTS:.0f} points: {v['ratios_within']} of {v['ratios']}: "
                     f"{met(v['ratios_within'] == v['ratios'])}")
        if v["ratios_with_rounds"]:
            lines.append(f"  the rounds' own ratios span <= {RATIO_POINTS:.0f} points in {v['ratios_resolved']} of "
                         f"{v['ratios_with_rounds']}; the simulated ratio lies inside that span in "
                         f"{v['ratios_inside']} of {v['ratios_with_rounds']}")
        for s in sped:
            if abs(s["error_points"]) > RATIO_POINTS:
                span = (f", rounds {min(s['measured_rounds']):.2f}-{max(s['measured_rounds']):.2f}"
                        if s["measured_rounds"] else "")
                lines.append(f"  {s['model']} {s['bandwidth']} {s['ranks']} ranks, {s['strategy']} ÷ {s['baseline']}: "
                             f"simulated {s['simulated']:.2f}, measured {s['measured']:.2f}{span} "
                             f"({s['error_points']:+.0f} points)")
    return lines
