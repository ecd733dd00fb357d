"""The `mpitrain` command: one sub-command per job, each the same program as `python -m jobs.<module>`.

    mpitrain --help                          every job, one line each
    mpiexec -n 4 mpitrain train --model vgg19 --data synthetic --strategy p3
    mpitrain bench --help                    the benchmarks
    mpitrain bench strategies --local --models mlp
    mpitrain train --help                    a job's own options

A sub-command runs its module as `python -m` would (runpy, as `__main__`), so under mpiexec or srun
every rank runs the same job, and a job that launches its own ranks (the benchmark drivers, the
simulator's --validate, cluster) does so from here too. Nothing here imports torch or starts MPI.
"""

from __future__ import annotations

import runpy
import sys

# (sub-command, module, how it runs, what it does). MPI: start it under mpiexec/srun on the ranks you
# want; alone: it needs no launcher (it starts its own ranks, or none). The order is the listing's.
COMMANDS = (
    ("train", "jobs.train", "MPI", "train a model: data parallel (every strategy) or pipeline"),
    ("bench", None, "", "the benchmarks: `mpitrain bench --help`"),
    ("simulate", "jobs.simulate", "alone", "project strategies to large clusters; --validate, --papers"),
    ("plan", "jobs.hybcomm_plan", "alone", "hybcomm's per-layer plan: sufficient factors or parameter server"),
    ("cache", "jobs.cache", "either", "the HDF5 sample cache: warm (MPI), info, verify, clear"),
    ("cluster", "jobs.cluster", "alone", "hosts in network namespaces, shaped links, MPI jobs across them (root)"),
    ("topology", "jobs.topology", "MPI", "how MPI sees this allocation: nodes, ranks per node, groups"),
    ("soak", "jobs.soak", "MPI", "thousands of steps under one strategy, watching for leaks"),
    ("gpu-check", "jobs.gpu_check.main", "alone", "every gpu test and GPU benchmark, one report (make gpu-check)"),
)
BENCHMARKS = (
    ("strategies", "jobs.bench.strategies", "alone", "each strategy's samples/s across link rates (and torch DDP)"),
    ("scaling", "jobs.bench.scaling", "alone", "samples/s on 1, 2, 4, 8 ... ranks over emulated links"),
    ("collectives", "jobs.bench.collectives", "MPI", "mpicomm's ring collectives against MPI's own, nccl-tests style"),
    ("links", "jobs.bench.links", "alone", "the emulated links: MPI's share of each rate and token bucket"),
    ("overhead", "jobs.bench.overhead", "MPI", "what the runtime itself costs per step and per wrap"),
    ("pipeline", "jobs.bench.pipeline", "alone", "pipeline modes against data parallel and torch's 1F1B"),
    ("pipeline-accuracy", "jobs.bench.pipeline_accuracy", "MPI", "SpecTrain's accuracy table: asynchronous pipelines"),
    ("pipeline-defaults", "jobs.bench.pipeline_defaults", "alone", "train's pipeline modes at its defaults, vs flush"),
    ("hybcomm-choice", "jobs.bench.hybcomm_choice", "alone", "does hybcomm's cost model pick the faster path"),
    ("mstopk", "jobs.bench.mstopk", "alone", "MSTopK against torch.topk, CPU or CUDA"),
    ("emulation", "jobs.bench.emulation", "alone", "emulated devices vs published figures; wait and step precision"),
    ("pto", "jobs.bench.pto", "MPI", "PTO's sharded optimizer step against the unsharded one"),
    ("convergence", "jobs.bench.convergence", "alone", "test accuracy of topk / hier-topk against dense"),
    ("cache", "jobs.bench.cache", "MPI", "data loading through datacache against a plain DataLoader"),
)
# The MPI sides that the benchmarks and the simulator start themselves: for running them on an
# allocation of your own (srun, sbatch; slurm/bench.sbatch runs strategies-worker).
WORKERS = (
    ("bench strategies-worker", "jobs.bench.strategies_worker", "MPI", "bench strategies on the ranks it is given"),
    ("bench pipeline-worker", "jobs.bench.pipeline_worker", "MPI", "bench pipeline on the ranks it is given"),
    ("bench pipeline-peer", "jobs.bench.pipeline_peer", "MPI", "torch.distributed.pipelining over gloo"),
    ("bench hybcomm-choice-worker", "jobs.bench.hybcomm_choice_worker", "MPI", "bench hybcomm-choice's rounds"),
    ("simulate-worker", "jobs.sim.worker", "MPI", "a model's profile on every rank at once, or the transport's costs"),
    ("gpu-check-xcheck", "jobs.gpu_check.xcheck", "alone", "gpu-check's throughput run again, compute emulated"),
)


def table(rows) -> str:
    width = max(len(row[0]) for row in rows)
    return "\n".join(f"  {name:<{width}}  {how:<6} {text}" for name, _, how, text in rows)


def usage() -> str:
    return ("usage: mpitrain COMMAND [options]      mpitrain COMMAND --help: its options\n"
            "       mpiexec -n 4 mpitrain train ...  (MPI: under mpiexec/srun; alone: no launcher needed)\n\n"
            f"commands:\n{table(COMMANDS)}\n\nbenchmarks (mpitrain bench NAME):\n{table(BENCHMARKS)}\n\n"
            f"their MPI sides, for your own allocation:\n{table(WORKERS)}\n\n"
            "Each is also `python -m MODULE`: python -m jobs.train, python -m jobs.bench.pipeline, ...")


def bench_usage() -> str:
    workers = [(n.removeprefix("bench "), *rest) for n, *rest in WORKERS if n.startswith("bench ")]
    return (f"usage: mpitrain bench NAME [options]   (mpitrain bench NAME --help: its options)\n\n"
            f"benchmarks:\n{table(BENCHMARKS)}\n\ntheir MPI sides:\n{table(workers)}")


def resolve(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """(command as typed, module, its arguments) for argv, or None where argv names no job."""
    commands = {n: m for n, m, *_ in COMMANDS + WORKERS if " " not in n}
    if not argv or argv[0] not in commands:
        return None
    if argv[0] != "bench":
        return f"mpitrain {argv[0]}", commands[argv[0]], argv[1:]
    benches = {n: m for n, m, *_ in BENCHMARKS} | {n.removeprefix("bench "): m for n, m, *_ in WORKERS
                                                    if n.startswith("bench ")}
    if len(argv) < 2 or argv[1] not in benches:
        return None
    return f"mpitrain bench {argv[1]}", benches[argv[1]], argv[2:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version
        try:
            print(f"mpitrain {version('mpitrain')}")
        except PackageNotFoundError:
            print("mpitrain (not installed: running from a source tree)")
        return 0
    found = resolve(argv)
    if found is None:
        if argv[0] == "bench":
            wanted = argv[1:2]
            if not wanted or wanted[0] in ("-h", "--help"):
                print(bench_usage())
                return 0 if wanted else 2
            print(f"error: mpitrain bench: no benchmark named {wanted[0]!r}\n\n{bench_usage()}", file=sys.stderr)
            return 2
        print(f"error: mpitrain: no command named {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    command, module, args = found
    from jobs.common import inputs
    inputs.COMMAND = (module, command)  # the jobs' usage lines name the command that was typed
    sys.argv = [command, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0
