"""Everything GPU in one run on a GPU machine: the gpu tests, the GPU benchmarks, the profiles; one report.

    make gpu-check                                  # the Makefile's target: the python on PATH, no set-up
    mpitrain gpu-check --out results/gpu-check
    mpitrain gpu-check --parts tests-serial,tests-mpi          # a subset, e.g. to rerun what failed

The parts, in this order (jobs.gpu_check.parts), each its own process with its own time limit and log:
tests-serial (plain pytest -m "gpu and not mpi"), tests-mpi (mpiexec -n 4 ... pytest -m "gpu and mpi"),
mstopk (MSTopK against torch.topk at 1M, 25M, 100M elements), overhead (a GPU model under allreduce, wfbp
and p3 against the same model's plain step, one rank: the staging's cost), profiles (one per model the
emulated accelerators stand in for, at its paper's batch: `--compute emulated:PATH`), throughput (every
strategy on an emulated cluster of 2 hosts x 2 ranks, real compute on the GPU; needs root), xcheck (the same
cluster again, compute emulated from this GPU's profile: real against emulated, jobs.gpu_check.xcheck). One part failing
or running out of time does not stop the others; --budget bounds the whole run (10 minutes by default,
setting-up included). Progress lines as it goes; FOLDER/report.md and FOLDER/report.json (rewritten after
each part), the logs under FOLDER/logs/, the benchmarks' JSON and the profiles beside them. Exit status 0
when every part passed, 1 otherwise; 2 (one line, nothing run) where torch sees no CUDA device.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import datetime, timezone

from jobs.common.inputs import InputError, JobParser, comma_list, link_rate, parse, positive
from jobs.gpu_check.parts import NAMES, ROOT, box_parts
from jobs.gpu_check.report import write_report
from jobs.gpu_check.runner import run_part

BANDWIDTH = "10gbit"  # the throughput part's links where --bandwidth is not given
BUDGET_S = 540  # of the 10 minutes: the set-up before (run.sh, a venv) and the report after


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.gpu_check.main", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", metavar="DIR", help="the run's folder (default gpu-check-YYYY-MM-DD-HHMM, UTC, here)")
    p.add_argument("--parts", default=",".join(NAMES), help=f"which, of {','.join(NAMES)} (default all)")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for all parts together (default {BUDGET_S}): a part gets at most what is left, "
                        "and one left with under 10 s is reported as not run")
    p.add_argument("--bandwidth", help=f"throughput and xcheck: the 2 x 2 cluster's links (default {BANDWIDTH})")
    return parse(p, argv, check_args)


def check_args(args) -> None:
    args.parts = comma_list("--parts", args.parts, NAMES)
    positive(args, "budget")
    # Checked, and refused where no part uses it: it reached the cluster unparsed, or was dropped without a word.
    if args.bandwidth is not None:
        if not {"throughput", "xcheck"} & set(args.parts):
            raise InputError("--bandwidth", "shapes the throughput and xcheck parts' links: neither is in --parts")
        link_rate("--bandwidth", args.bandwidth)
    args.bandwidth = args.bandwidth or BANDWIDTH
    args.out = os.path.abspath(args.out or default_folder())
    check_cuda()


def check_cuda() -> None:
    """Stop at once, one line, where torch sees no GPU: every part would fail, each after its own start-up."""
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else \
            f"built for CUDA {torch.version.cuda}; check the driver and CUDA_VISIBLE_DEVICES"
        raise InputError("", f"gpu-check needs a CUDA device, and torch {torch.__version__} sees none ({build}): "
                             "run it on a GPU machine")


def default_folder() -> str:
    return "gpu-check-" + datetime.now(timezone.utc).strftime("%Y-%m-%d-%H%M")


def run_metadata(argv) -> dict:
    """When, where and on what: the GPU, torch, CUDA, the machine, the commit (where the checkout has git)."""
    import torch

    from jobs.common.report import machine, machine_line

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    args = sys.argv[1:] if argv is None else list(argv)
    return dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                command=" ".join(["python", "-m", "jobs.gpu_check.main", *args]), gpu=torch.cuda.get_device_name(0),
                gpus=torch.cuda.device_count(), torch=torch.__version__, cuda=torch.version.cuda,
                machine=machine_line(machine()).removeprefix("machine: "), commit=commit, python=sys.executable)


def run_all(parts, folder: str, meta: dict, budget_s: float, say=print, **run) -> list:
    """Run the parts in order, each within what is left of budget_s, the report rewritten after each: a part that
    fails, or runs out of time, is reported and the next one starts. Their results."""
    start = time.monotonic()
    results = []
    write_report(folder, results, meta, [p.name for p in parts])
    for i, part in enumerate(parts):
        say(f"{part.name}: {part.title} (limit {part.limit_s:.0f} s)")
        result = run_part(part, folder, budget_s - (time.monotonic() - start), say, cwd=ROOT, **run)
        results.append(result)
        write_report(folder, results, meta, [p.name for p in parts[i + 1:]])
        say(f"{part.name}: {result.status.upper()} in {result.seconds:.0f} s"
            + (f" ({result.problem}); log: {os.path.join(folder, result.log)}" if result.problem else ""))
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()

    def say(message: str) -> None:
        print(f"[gpu-check {time.monotonic() - start:4.0f} s] {message}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    meta = run_metadata(argv)
    parts = box_parts(args.out, meta["gpu"], args.parts, args.bandwidth)
    say(f"writing to {args.out}/ (report.md, report.json, logs/): {len(parts)} parts on {meta['gpu']}, "
        f"budget {args.budget:.0f} s")
    results = run_all(parts, args.out, meta, args.budget, say)
    failed = [r.name for r in results if not r.passed]
    say(("all parts passed" if not failed else f"{len(failed)} of {len(results)} parts failed: {', '.join(failed)}")
        + f"; report: {os.path.join(args.out, 'report.md')} and report.json")
    return 1 if failed else 0


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
