r"""The simulator against the emulated cluster: measured and simulated T_iter for every model, strategy, size and link.

    mpitrain simulate --validate --json results/validation.json             # as root: everything
    mpitrain simulate --validate --ranks 4 --bandwidths 1gbit --models vgg19 --strategies wfbp,p3
    mpitrain simulate --validate --measured benchmarks/issue15/measured-4r-1gbit.json,... \
        --profiles benchmarks/issue15/profiles --calibration benchmarks/issue15/calibration.json
    mpitrain simulate --validate --compute emulated:p4000 --bandwidths 2.5gbit,10gbit --carry-at 1gbit \
        --models resnet50-224 --strategies allreduce,wfbp,p3,ddp               # emulated compute
    mpitrain simulate --validate --compute emulated:1080ti --compute-scale 10 --bandwidths 100mbit,1gbit \
        --ranks 4 --pipeline-models fc-heavy --strategies pipeline-flush,pipeline-vanilla   # pipelines

Four stages, each skipped when its result is given:
  1. profiles (--profiles DIR, files MODEL-bBATCH-rRANKS.json; missing ones are
     taken): every model profiled on R ranks of this machine at once
     (jobs.sim.worker profile), for each rank count R of the grid, so that the
     profile carries what R ranks computing together cost each other here;
  2. calibration (--calibration, jobs.sim.calibration): jobs.sim.worker
     transport on the emulated cluster, unshaped (one connection's rate, CPU
     time per byte, latency) and at each bandwidth (the share of the line rate
     the ring's payload gets, and a chain of streams: the pipelines'),
     microbenchmarks only;
  3. measurements (--measured): jobs.bench over the emulated cluster, R hosts
     of one rank, every bandwidth, model and strategy; the pipeline-MODE
     strategies by jobs.bench.pipeline on --pipeline-models (one stage a
     rank), simulated on the run's own split and micro-batch;
  4. simulation of each measured row from the profile, the calibration and
     one figure per strategy from its synchronisation timed alone (jobs.bench's
     T_comm and comm CPU): the cores its communication machinery took while
     the link was busy (MPICH spinning in a wait, a progress thread polling),
     which on a machine whose cores the ranks share slows whatever computes
     beside it. The measured T_iter is never an input; the table shows the
     simulation without that CPU figure too.
With --compute emulated:DEVICE (and --compute-scale, --carry-at) the
measurements run with emulated compute and no profile is taken: each row is
simulated from the compute model its run waited on (jobs.sim.modelled: the
same trace, the same seconds per layer, the compute on an accelerator of its
own, not on the shared cores), on hosts of the row's ranks per host; a carried
row is simulated as it ran (its links, its compute scale) and reported at the
rate asked, as jobs.bench reports it. Rows given with --measured that ran
emulated are simulated so whatever --compute says.
Prints measured and simulated T_iter with the error per configuration and,
per configuration, whether the simulator ranks the strategies as measured,
with how many of the pairs that the measured rounds order (every round of one
faster than every round of the other) it keeps in that order; then the
verdict against issue 27's target 5 (jobs.sim.agreement): mean and worst
|error|, the pairs kept, and each strategy's speed-up over --baseline
simulated against measured, in points, beside the span of the ratio round by
round (what the measurement itself resolves). Writes JSON rows (rankings,
speed-ups and verdict in its metadata) and a PNG (simulated against measured,
the +-10 % band shaded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jobs.common.carry import add_carry_argument, check_carry
from jobs.common.compute import add_compute_arguments, check_compute
from jobs.common.inputs import InputError, JobParser, at_least, bench_outputs, comma_list, int_list, parse
from jobs.sim.agreement import rankings, speedups, verdict, verdict_lines
from jobs.sim.calibration import calibrate, emulated_cluster, for_hosts
from jobs.sim.validate_report import figure_title, markdown, plot

STRATEGIES = "allreduce,wfbp,p3,ddp,hybcomm,topk,allreduce+pto"


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.simulate --validate", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--ranks", default="4,8", help="emulated hosts of one rank each (default 4,8)")
    p.add_argument("--bandwidths", default="1gbit,2.5gbit,10gbit")
    p.add_argument("--models", default="vgg19,resnet50,transformer")
    p.add_argument("--pipeline-models", default="fc-heavy",
                   help="the models of the pipeline-MODE strategies (jobs.bench.pipeline, one stage a rank; default "
                        "fc-heavy); the others run on --models")
    p.add_argument("--strategies", default=STRATEGIES, help=f"default {STRATEGIES}")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="jobs.bench's (default 2)")
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--profiles", metavar="DIR", default="benchmarks/issue15/profiles")
    p.add_argument("--calibration", metavar="JSON", help="default: measured, and written beside --json")
    p.add_argument("--measured", help="jobs.bench JSON files, comma-separated (default: measured now)")
    p.add_argument("--baseline",
                   help="the strategy each speed-up is taken over, one of --strategies (default allreduce, or the "
                        "first of --strategies without it)")
    p.add_argument("--timeout", type=float, default=7200)
    add_compute_arguments(p)
    add_carry_argument(p)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG", help="default: the JSON path with .png")
    return parse(p, argv, check_args)


def check_args(args) -> None:
    """Every stage's grid, here: calibration takes minutes before jobs.bench would refuse a name."""
    from jobs.common.choices import MODELS, PIPELINE_MODES, SEQUENTIAL_MODELS

    args.ranks = int_list("--ranks", args.ranks, 2)
    args.bandwidths = comma_list("--bandwidths", args.bandwidths)  # a list before check_carry reads it
    args.models = comma_list("--models", args.models, MODELS)
    args.strategies = comma_list("--strategies", args.strategies)
    args.pipeline_models = comma_list("--pipeline-models", args.pipeline_models, SEQUENTIAL_MODELS)
    args.modes = [s.removeprefix("pipeline-") for s in args.strategies if s.startswith("pipeline-")]
    for mode in args.modes:
        if mode not in PIPELINE_MODES:
            raise InputError("--strategies", f"unknown 'pipeline-{mode}' (the pipeline modes: "
                                             f"{', '.join('pipeline-' + m for m in PIPELINE_MODES)})")
    check_dense(args, [s for s in args.strategies if not s.startswith("pipeline-")])
    if args.baseline is None:
        args.baseline = "allreduce" if "allreduce" in args.strategies else args.strategies[0]
    if args.baseline not in args.strategies:
        raise InputError("--baseline", f"{args.baseline!r} is not among --strategies ({', '.join(args.strategies)})")
    args.measured = comma_list("--measured", args.measured) if args.measured else []
    for path in args.measured + ([args.calibration] if args.calibration else []):
        if not os.path.isfile(path):
            raise InputError("--measured" if path in args.measured else "--calibration", f"no such file: {path}")
    at_least(args, 1, "batch_size", "rounds", "batches", "iters")
    at_least(args, 0, "warmup")
    check_compute(args)
    args.local = False  # what check_carry asks: the validation always runs on the emulated cluster
    check_carry(args)
    if args.modes and args.carry_at and not args.measured:
        raise InputError("--carry-at", "the pipeline benchmark runs at the rates asked: for the pipeline-MODE "
                         "strategies give --compute-scale and slower --bandwidths instead")
    bench_outputs(args)
    check_links(args)  # last: mpicomm.emulation imports torch


def check_dense(args, dense: list[str]) -> None:
    """The data-parallel strategies as jobs.bench checks them (its contenders' names and variants)."""
    from jobs.bench.contenders import check_settings

    if dense:
        check_settings(argparse.Namespace(strategies=",".join(dense), batch_size=args.batch_size, batches=args.batches,
                                          iters=args.iters, rounds=args.rounds, threads=1, slice_size="auto",
                                          credit="auto", warmup=args.warmup, density=0.001))


def check_links(args) -> None:
    """--bandwidths (a list by now): rates the emulated cluster can shape; --ranks: hosts of one rank, at most
    MAX_HOSTS."""
    from mpicomm.emulation import EmulationError, parse_bandwidth
    from mpicomm.emulation.netns import MAX_HOSTS

    for bw in args.bandwidths:
        try:
            parse_bandwidth(bw)
        except EmulationError as exc:
            raise InputError("--bandwidths", str(exc)) from None
    if max(args.ranks) > MAX_HOSTS:
        raise InputError("--ranks", f"each is a host of one rank: at most {MAX_HOSTS}, got {max(args.ranks)}")


def profiles(args, needed) -> dict:
    """{(model, ranks): Profile} for each (model, ranks) needed, taking those not in --profiles."""
    from jobs.sim.profiles import take_profile
    from runtime.sim import Profile

    out = {}
    for ranks in args.ranks:
        for model in args.models:
            if (model, ranks) not in needed:
                continue
            path = os.path.join(args.profiles, f"{model}-b{args.batch_size}-r{ranks}.json")
            if not os.path.exists(path):
                print(f"# profiling {model} on {ranks} ranks at once -> {path}", flush=True)
                take_profile(model, ranks, path, args.batch_size, args.timeout)
            out[model, ranks] = Profile.load(path)
    return out


def measure(args) -> list[dict]:
    """jobs.bench over the grid: one JSON per rank count, beside --json (or in the working directory)."""
    from jobs.bench import strategies as bench

    rows = []
    stem = os.path.splitext(args.json)[0] if args.json else "validation"
    dense = [s for s in args.strategies if not s.startswith("pipeline-")]
    for ranks in args.ranks:
        if args.modes:
            rows += measure_pipelines(args, ranks, f"{stem}-pipelines-{ranks}r.json")
        if not dense:
            continue
        path = f"{stem}-measured-{ranks}r.json"
        status = bench.main(["--models", ",".join(args.models), "--bandwidths", ",".join(args.bandwidths), "--hosts",
                             str(ranks), "--strategies", ",".join(dense), "--rounds", str(args.rounds),
                             "--batches", str(args.batches), "--iters", str(args.iters), "--warmup",
                             str(args.warmup), "--batch-size", str(args.batch_size), "--timeout", str(args.timeout),
                             "--json", path, "--compute", args.compute, "--compute-scale", repr(args.compute_scale),
                             *(["--carry-at", args.carry_at] if args.carry_at else [])])
        check_status("jobs.bench", ranks, status, path)
        rows += _rows(path)
    return rows


class MeasureFailed(Exception):
    """A measuring benchmark failed: validating the rest would compare a grid with holes."""


def check_status(job: str, ranks: int, status: int, path: str) -> None:
    """Stop when a benchmark run failed (it said why): where the rows it measured are kept, if anywhere."""
    if status:
        kept = f"; the rows it measured: {path}" if os.path.exists(path) else ""
        raise MeasureFailed(f"{job} on {ranks} ranks failed (exit {status}){kept}")


def measure_pipelines(args, ranks: int, path: str) -> list[dict]:
    """jobs.bench.pipeline's modes on --pipeline-models, one stage a rank (a model with fewer layers holding
    parameters than `ranks` is left out, said), timing as many steps a round as jobs.bench's batches do."""
    from jobs.bench import pipeline as bench
    from runtime.pipeline import as_layers
    from runtime.workloads.models import build_model

    models = []
    for m in args.pipeline_models:
        owners = sum(any(p.requires_grad for p in layer.parameters()) for layer in as_layers(build_model(m)))
        if owners < ranks:
            print(f"# pipelines: {m} has {owners} layers with parameters, fewer than {ranks} stages: left out")
        else:
            models.append(m)
    if not models:
        return []
    status = bench.main(["--models", ",".join(models), "--bandwidths", ",".join(args.bandwidths), "--hosts",
                         str(ranks), "--contenders", ",".join(args.modes), "--rounds", str(args.rounds),
                         "--iters", str(args.iters * args.batches), "--warmup", str(args.warmup), "--timeout",
                         str(args.timeout), "--json", path, "--compute", args.compute, "--compute-scale",
                         repr(args.compute_scale)])
    check_status("jobs.bench.pipeline", ranks, status, path)
    return _rows(path)


def _rows(path: str) -> list[dict]:
    """A jobs.bench JSON's rows; a jobs.bench.pipeline JSON's as pipeline_row makes them."""
    from jobs.sim.modelled import pipeline_row

    with open(path) as f:
        rows = json.load(f)["rows"]
    return [r for r in (pipeline_row(r) if "contender" in r else r for r in rows) if r is not None]


POLLING = ("wfbp", "p3")  # strategies whose exchange a progress thread drives beside the training thread


def comm_cores(rows: list[dict], cal: dict) -> dict:
    """{(model, strategy, bandwidth, ranks): cores per rank} a progress thread took while its exchange was
    pending, from the strategy's synchronisation timed alone (jobs.bench's T_comm and comm CPU): the
    CPU-seconds per second per rank, less the copies the calibration already charges per byte. hybcomm has
    no synchronisation alone: its dense path's (wfbp's) stands in. The others' waits block the training
    thread itself (MPICH's spin, which the ring's calibrated rate already carries; gloo's blocking
    reads; top-k's selection, which the profile times): nothing computes beside them."""
    out = {}
    for r in rows:
        if r["strategy"] in POLLING and r.get("t_comm_s") and r.get("comm_cpu_s") is not None:
            t_comm = r["t_comm_s"] * (r.get("carry_factor") or 1.0)  # as it ran: a carried row reports it divided
            per_byte = for_hosts(cal, r.get("nodes") or r["ranks"])["transport"]["cpu_per_byte"]
            copies = per_byte * (r.get("wire_bytes_per_host_per_step") or 0) / t_comm
            out[r["model"], r["strategy"], r["bandwidth"], r["ranks"]] = \
                max(0.0, r["comm_cpu_s"] / (t_comm * r["ranks"]) - copies)
    for (model, s, bw, ranks), v in list(out.items()):
        if s == "wfbp":
            for other in ("hybcomm", "hybcomm-sfb", "hybcomm-ps"):
                out.setdefault((model, other, bw, ranks), v)
    return out


def compare(measured: list[dict], profs: dict, cal: dict, density: float = 1e-3) -> list[dict]:
    """One row per measured one: simulated with and without the strategies' measured CPU while communicating."""
    from jobs.sim.modelled import emulated, row_profile
    from runtime.sim import UnknownStrategyError, simulate

    shares = comm_cores(measured, cal)
    out, seen_compute = [], set()
    for m in measured:
        key = (m["model"], m["ranks"])
        if m.get("t_iter_s") is None or (key not in profs and not emulated(m)):
            continue
        # A carried row ran on slower links with its compute scaled alike (jobs.common.carry): simulated as it
        # ran, then reported at the rate asked, as its measured figures are.
        f = m.get("carry_factor") or 1.0
        if emulated(m):
            prof = row_profile(m)
            cluster = emulated_cluster(m["ranks"], m.get("carried_links") or m["bandwidth"], cal,
                                       float(m.get("cores") or os.cpu_count() or 1), m.get("nodes"), "gpu",
                                       streams=m["strategy"].startswith("pipeline-"))
        else:
            prof = profs[key]
            cluster = emulated_cluster(m["ranks"], m["bandwidth"], cal, prof.cores)
        if (key, m["bandwidth"]) not in seen_compute and m.get("t_compute_s"):
            seen_compute.add((key, m["bandwidth"]))
            sim = simulate(prof, cluster, "compute").t_iter_s / f
            out.append(_row(m, "compute", m["t_compute_s"], sim, sim, 0.0))
        opts = {"density": m.get("density") or density} if "topk" in m["strategy"] else m.get("sim_options", {})
        share = shares.get((m["model"], m["strategy"], m["bandwidth"], m["ranks"]), 0.0)
        try:
            bare = simulate(prof, cluster, m["strategy"], **opts).t_iter_s / f
            sim = simulate(prof, cluster.with_(comm_cores=share), m["strategy"], **opts).t_iter_s / f if share else bare
        except UnknownStrategyError:
            continue
        out.append(_row(m, m["strategy"], m["t_iter_s"], sim, bare, share))
    return out


def _row(m: dict, strategy: str, measured: float, simulated: float, bare: float, share: float) -> dict:
    return dict(model=m["model"], strategy=strategy, bandwidth=m["bandwidth"], ranks=m["ranks"],
                measured_s=measured, simulated_s=simulated, error=(simulated - measured) / measured,
                comm_cores=share, simulated_without_comm_cpu_s=bare, error_without_comm_cpu=(bare - measured) / measured,
                measured_rounds_s=list(m.get("t_iter_rounds_s") or []) if strategy != "compute" else [],
                **{k: m.get(k, v) for k, v in COMPUTE_FIELDS.items()})


# The compute each measured row ran under (jobs.bench's and jobs.bench.pipeline's rows; real when absent).
COMPUTE_FIELDS = dict(compute="real", compute_device=None, compute_scale=1.0)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jobs.common.report import machine, run_metadata, write_document, write_json

    if args.calibration:
        with open(args.calibration) as f:
            cal = json.load(f)
    else:
        cal = calibrate(args)
        path = (os.path.splitext(args.json)[0] if args.json else "validation") + "-calibration.json"
        write_document(path, cal)
    from jobs.sim.modelled import emulated

    try:
        measured = [r for p in args.measured for r in _rows(p)] if args.measured else measure(args)
    except MeasureFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    measured = [r for r in measured if r["model"] in args.models + args.pipeline_models and r["ranks"] in args.ranks
                and r["bandwidth"] in args.bandwidths and r["strategy"] in args.strategies]
    # Profiles for the rows that computed for real; an emulated row is simulated from its compute model (compare).
    profs = profiles(args, {(r["model"], r["ranks"]) for r in measured if not emulated(r)})
    rows = compare(measured, profs, cal)
    if not rows:
        print("error: no measured row matches the grid (--models, --ranks, --bandwidths, --strategies)",
              file=sys.stderr)
        return 1
    print(figure_title(rows).split("\n", 1)[1])  # the compute and the machine, above the table
    print(f"transport: {json.dumps(cal['transport'])}")
    print(markdown(rows))
    ranked, sped = rankings(rows), speedups(rows, args.baseline)
    for k in ranked:
        print(f"ranking, {k['model']} {k['bandwidth']} {k['ranks']} ranks: {'same' if k['same_order'] else 'differs'}; "
              f"{k['separated'] - len(k['swapped'])} of the {k['separated']} pairs the rounds order (of {k['pairs']}) "
              f"in the same order" + (f", swapped: {', '.join(k['swapped'])}" if k["swapped"] else ""))
    judged = verdict(rows, ranked, sped)
    print("\n" + "\n".join(verdict_lines(judged, sped)))
    if args.json:
        write_json(args.json, run_metadata("jobs.simulate", ["--validate", *(argv or sys.argv[1:])],
                                           machine=machine(), calibration=cal, rankings=ranked,
                                           speedups=sped, verdict=judged), rows)
    if args.plot:
        plot(rows, args.plot, figure_title(rows))
    return 0


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
