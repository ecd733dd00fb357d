"""The strategy benchmark's rows: a strategy's rounds made medians with CIs, overlap per round, the raw rounds kept."""

from __future__ import annotations

import os
import statistics

from jobs.common.choices import SPARSE_STRATEGIES as SPARSE
from jobs.common.stats import summary


def overlap(t_compute: float, t_comm: float, t_iter: float) -> float:
    """Overlap efficiency, the issue's and the papers' figure: max(T_compute, T_comm) / T_iter, at most 1.

    1: the step took as long as its longer phase alone (the other wholly hidden); (max / sum) when
    the two ran back to back, which is 0.5 for equal phases but near 1 for a step dominated by one
    phase, hidden or not: hidden_share() says how much of the shorter phase was hidden. Clipped
    because phases timed alone are not the phases inside a step: a step shorter than its longer
    phase alone (the sync alone contending differently) would read above 1.
    """
    return min(1.0, max(t_compute, t_comm) / t_iter)


def hidden_share(t_compute: float, t_comm: float, t_iter: float) -> float:
    """The share of the shorter phase hidden behind the longer: (T_compute + T_comm - T_iter) / min(both), in [0, 1].

    0: the step took as long as both phases back to back; 1: as long as the longer phase alone.
    Clipped for the same reason as overlap(), and below at 0 for a step longer than both phases
    together (hooks, copies).
    """
    return min(1.0, max(0.0, (t_compute + t_comm - t_iter) / min(t_compute, t_comm)))


def row(args, b, name: str, mine: list[dict], plain: list[dict]) -> dict:
    """A strategy's JSON row from its rounds and the plain step's same rounds: medians, CIs, the raw rounds.

    b: the worker's Bench (ranks, nodes, device); mine, plain: Bench.measure's dicts, one per round.
    """
    rounds = dict(t_iter=[r["t_iter"] for r in mine], t_compute=[r["t_iter"] for r in plain],
                  compute_cpu=[r["cpu"] for r in plain])
    rounds.update(t_comm=None, comm_cpu=None, overlap=None, hidden_share=None)  # hybcomm's (see strategies_worker)
    rounds["step_cpu"] = [r["step_cpu"] for r in mine]
    if mine[0]["t_comm"] is not None:
        rounds.update(t_comm=[r["t_comm"] for r in mine], comm_cpu=[r["comm_cpu"] for r in mine])
        # Each round's own three times: an overlap never mixes a fast round's step with a slow one's phases.
        phases = list(zip(rounds["t_compute"], rounds["t_comm"], rounds["t_iter"]))
        rounds["overlap"] = [overlap(*times) for times in phases]
        rounds["hidden_share"] = [hidden_share(*times) for times in phases]
    stats = {k: summary(v) for k, v in rounds.items() if v is not None}

    def med(key):
        return stats[key]["median"] if key in stats else None

    def ci(key):
        return stats[key]["ci"] if key in stats else None
    per_step = args.batch_size * b.P  # samples per step, all ranks
    rate, (fast, slow) = per_step / med("t_iter"), ci("t_iter")
    rate_ci = [per_step / slow, per_step / fast]  # the same order statistics, read as rates
    # Medians of the per-round byte counts (they differ by the odd barrier, not by the round's luck).
    wire = {k: None if mine[0]["wire"][k] is None else statistics.median(r["wire"][k] for r in mine)
            for k in mine[0]["wire"]}
    traffic = {k: statistics.median(r["traffic"][k] for r in mine) for k in mine[0]["traffic"]}
    out = dict(model=args.model, strategy=name, bandwidth=args.bandwidth, ranks=b.P,
               batch_per_rank=args.batch_size, samples_per_s=rate,
               ci=max(rate_ci[1] - rate, rate - rate_ci[0]),  # ± that covers samples_per_s_ci
               samples_per_s_ci=rate_ci, ci_coverage=stats["t_iter"]["coverage"], rounds=len(mine),
               t_iter_s=med("t_iter"), t_iter_ci=ci("t_iter"), t_compute_s=med("t_compute"),
               t_compute_ci=ci("t_compute"), t_comm_s=med("t_comm"), t_comm_ci=ci("t_comm"),
               overlap_efficiency=med("overlap"), overlap_ci=ci("overlap"), hidden_share=med("hidden_share"),
               hidden_share_ci=ci("hidden_share"),
               # CPU-seconds per step, all ranks' processes: with compute and communication sharing the
               # cores, T_iter >= (compute_cpu + comm_cpu) / cores whatever the overlap.
               compute_cpu_s=med("compute_cpu"), comm_cpu_s=med("comm_cpu"), step_cpu_s=med("step_cpu"),
               cores=os.cpu_count(),
               threads=args.threads, nodes=b.topo.num_nodes, optimizer=args.optimizer,
               device=b.device_info["type"], device_name=b.device_info["name"], cuda=b.device_info["cuda"],
               transport=mine[-1]["transport"], **wire, **traffic,
               **{f"{k}_rounds" + ("" if k in ("overlap", "hidden_share") else "_s"): v for k, v in rounds.items()},
               t_iter_batches_s=[r["batches"] for r in mine])
    out.update(steps(args, b, mine))
    if name.removesuffix("+pto") in SPARSE:
        out["density"] = args.density
    if mine[-1]["plan"] is not None:
        out["plan"] = mine[-1]["plan"]
    if mine[-1].get("p3") is not None:  # what p3 chose, and its messages and polls per step (medians)
        out["p3_settings"] = mine[-1]["p3"]["settings"]
        if "online" in mine[-1]["p3"]:  # credit="online": the trials and the credit kept, per round
            out["p3_online"] = [r["p3"]["online"] for r in mine]
        for key in ("messages", "polls", "comm_polls"):
            values = [r["p3"][key] for r in mine if key in r["p3"]]
            out[f"p3_{key}_per_step"] = statistics.median(values) if values else None
    return out


def steps(args, b, mine: list[dict]) -> dict:
    """How the row's steps were run and what they used of the host: the compute mode (jobs.common.compute),
    the modelled device seconds per step (emulated, else None), peak memory, ranks per core, the step counts."""
    modelled = [r["modelled"] for r in mine]
    parts = None if None in modelled else {k: statistics.median(m.get(k, 0.0) for m in modelled)
                                          for k in dict.fromkeys(k for m in modelled for k in m)}
    rss = [r["rss"] for r in mine]
    return dict(**b.compute.describe(), compute_label=b.compute.label,
                modelled_compute_s=None if parts is None else sum(parts.values()), modelled_parts_s=parts,
                peak_rss_mb=None if rss[0][0] is None else max(r[0] for r in rss),
                peak_rss_ranks_mb=None if rss[0][1] is None else max(r[1] for r in rss),
                ranks_per_core=b.ranks_per_core, warmup=args.warmup, batches=args.batches, iters=args.iters)
