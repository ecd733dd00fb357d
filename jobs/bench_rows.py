"""jobs.bench_worker's rows: a strategy's rounds made medians with CIs, overlap per round, the raw rounds kept."""

from __future__ import annotations

import os
import statistics

from jobs.choices import SPARSE_STRATEGIES as SPARSE
from jobs.stats import summary


def overlap(t_compute: float, t_comm: float, t_iter: float) -> float:
    """The share of the shorter phase hidden behind the longer: (T_compute + T_comm - T_iter) / min(both), in [0, 1].

    0: the step took as long as both phases back to back; 1: as long as the longer phase alone. It is
    clipped because phases timed alone are not the phases inside a step: a step shorter than its
    longer phase alone (the sync alone contending differently) would read above 1, one longer than
    both together (hooks, copies) below 0. Not max(T_compute, T_comm) / T_iter: that reads 0.5, not 0,
    for no overlap at all, and near 1 for any step dominated by one phase, hidden or not.
    """
    return min(1.0, max(0.0, (t_compute + t_comm - t_iter) / min(t_compute, t_comm)))


def row(args, b, name: str, mine: list[dict], plain: list[dict]) -> dict:
    """A strategy's JSON row from its rounds and the plain step's same rounds: medians, CIs, the raw rounds.

    b: the worker's Bench (ranks, nodes, device); mine, plain: Bench.measure's dicts, one per round.
    """
    rounds = dict(t_iter=[r["t_iter"] for r in mine], t_compute=[r["t_iter"] for r in plain],
                  compute_cpu=[r["cpu"] for r in plain])
    rounds.update(t_comm=None, comm_cpu=None, overlap=None)  # hybcomm's (jobs.bench_worker's docstring says why)
    if mine[0]["t_comm"] is not None:
        rounds.update(t_comm=[r["t_comm"] for r in mine], comm_cpu=[r["comm_cpu"] for r in mine])
        # Each round's own three times: an overlap never mixes a fast round's step with a slow one's phases.
        rounds["overlap"] = [overlap(c, m, i) for c, m, i in zip(rounds["t_compute"], rounds["t_comm"],
                                                                 rounds["t_iter"])]
    stats = {k: summary(v) for k, v in rounds.items() if v is not None}
    med = lambda k: stats[k]["median"] if k in stats else None  # noqa: E731
    ci = lambda k: stats[k]["ci"] if k in stats else None  # noqa: E731
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
               overlap_efficiency=med("overlap"), overlap_ci=ci("overlap"),
               # Machine-wide CPU-seconds per step (rank 0's reading): with compute and communication
               # sharing the cores, T_iter >= (compute_cpu + comm_cpu) / cores whatever the overlap.
               compute_cpu_s=med("compute_cpu"), comm_cpu_s=med("comm_cpu"), cores=os.cpu_count(),
               threads=args.threads, nodes=b.topo.num_nodes, optimizer=args.optimizer,
               device=b.device_info["type"], device_name=b.device_info["name"], cuda=b.device_info["cuda"],
               transport=mine[-1]["transport"], **wire, **traffic,
               **{f"{k}_rounds" + ("" if k == "overlap" else "_s"): v for k, v in rounds.items()},
               t_iter_batches_s=[r["batches"] for r in mine])
    if name.removesuffix("+pto") in SPARSE:
        out["density"] = args.density
    if mine[-1]["plan"] is not None:
        out["plan"] = mine[-1]["plan"]
    return out
