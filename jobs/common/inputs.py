"""Checking a job's command line before any MPI or cluster work: one `error: --option: reason` line, exit 2."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from typing import Callable, Iterable


class InputError(ValueError):
    """A bad command-line value; str() is `--option: reason`."""

    def __init__(self, option: str, reason: str):
        super().__init__(f"{option}: {reason}" if option else reason)


# (module, command) when the job runs as a sub-command of `mpitrain` (jobs.cli): usage lines name the command.
COMMAND: tuple[str, str] | None = None


class JobParser(argparse.ArgumentParser):
    """argparse whose own errors (not a number, unknown choice, missing option) are InputErrors too.

    argparse would print its usage, dozens of lines for the bigger jobs, before the one line that matters.
    `prog` is `python -m MODULE ...`; under `mpitrain` that prefix reads as the command typed instead.
    """

    def __init__(self, *args, prog: str | None = None, **kw):
        if COMMAND and prog and prog.split()[:3] == ["python", "-m", COMMAND[0]]:
            prog = " ".join([COMMAND[1], *prog.split()[3:]])
        super().__init__(*args, prog=prog, **kw)

    def error(self, message: str):
        if message.startswith("argument "):  # "argument --model: invalid choice: ..."
            option, _, reason = message[len("argument "):].partition(": ")
            raise InputError(option, reason)
        raise InputError("", message)


def option(name: str) -> str:
    """The command-line spelling of an argparse dest: slice_size -> --slice-size."""
    return "--" + name.replace("_", "-")


def _values(args, names):
    """(option, value) for each given name whose value is set (None: the option was not given)."""
    return [(option(n), getattr(args, n)) for n in names if getattr(args, n) is not None]


def at_least(args, minimum: float, *names: str) -> None:
    """Counts, rates, seconds: a finite number >= minimum. `value < minimum` alone lets NaN through (every
    comparison with NaN is False), and no caller has a use for inf (--lr inf, --latency inf: a run that cannot end
    or ends in NaN)."""
    for opt, value in _values(args, names):
        if not math.isfinite(value):
            raise InputError(opt, f"must be a finite number >= {minimum:g}, got {value}")
        if value < minimum:
            raise InputError(opt, f"must be >= {minimum:g}, got {value}")


def auto_or_count(args, *names: str, words=("auto",)) -> None:
    """Options such as --slice-size that take "auto" (or another of `words`) or a whole number >= 1: converted
    in place."""
    allowed = " or ".join(words)
    for opt, value in _values(args, names):
        if value in words:
            continue
        try:
            number = int(value)
        except ValueError:
            raise InputError(opt, f"must be {allowed} or a whole number >= 1, got {value!r}") from None
        if number < 1:
            raise InputError(opt, f"must be {allowed} or a whole number >= 1, got {number}")
        setattr(args, opt[2:].replace("-", "_"), number)


def between(args, low: float, high: float, *names: str) -> None:
    for opt, value in _values(args, names):
        if not low <= value <= high:
            raise InputError(opt, f"must be between {low:g} and {high:g}, got {value}")


def positive(args, *names: str) -> None:
    for opt, value in _values(args, names):
        if not value > 0:
            raise InputError(opt, f"must be > 0, got {value}")


def positive_finite(args, *names: str) -> None:
    """Sizes and factors that are a finite number > 0 (positive() allows inf: a --timeout of no limit)."""
    for opt, value in _values(args, names):
        if not (value > 0 and math.isfinite(value)):
            raise InputError(opt, f"must be a finite number > 0, got {value}")


def fraction(args, *names: str) -> None:
    """Densities: in (0, 1]."""
    for opt, value in _values(args, names):
        check_fraction(opt, value)


def check_fraction(opt: str, value: float) -> None:
    if not 0 < value <= 1:
        raise InputError(opt, f"must be in (0, 1], got {value}")


def one_of(opt: str, value, allowed: Iterable) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise InputError(opt, f"unknown {value!r} (choose from {', '.join(map(str, allowed))})")


def comma_list(opt: str, text: str, allowed: Iterable | None = None,
               parse: Callable[[str], object] | None = None, unique: bool | None = None) -> list:
    """'a,b,c' -> [a, b, c]: at least one item, each in `allowed` and/or converted by `parse`.

    `parse` may raise ValueError or argparse.ArgumentTypeError; the message names the option.
    unique (default: where `allowed` names the choices): a repeated item is refused. A benchmark measured a
    contender listed twice twice per round and merged both under one name; no list of names means one twice.
    """
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise InputError(opt, f"needs at least one value, got {text!r}")
    if allowed is not None:
        for item in items:
            one_of(opt, item, allowed)
    out = items
    if parse is not None:
        out = []
        for item in items:
            try:
                out.append(parse(item))
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise InputError(opt, f"{item!r}: {exc}") from None
    if unique or (unique is None and allowed is not None):
        seen = []
        for item, value in zip(items, out):
            if value in seen:
                raise InputError(opt, f"{item!r} is listed twice")
            seen.append(value)
    return out


def int_list(opt: str, text: str, minimum: int) -> list[int]:
    """'2,8,32' -> [2, 8, 32]: comma_list of whole numbers, each >= minimum."""
    values = comma_list(opt, text, parse=int)
    if min(values) < minimum:
        raise InputError(opt, f"each must be >= {minimum}, got {min(values)}")
    return values


def link_rate(opt: str, text: str) -> int:
    """A link rate in bit/s ('1gbit', '2.5gbit'), not the cluster jobs' "none": a cost model needs a number.

    Last in a check: mpicomm.emulation imports torch.
    """
    from mpicomm.emulation import EmulationError, parse_bandwidth

    try:
        bps = parse_bandwidth(text)
    except EmulationError as exc:
        raise InputError(opt, str(exc)) from None
    if bps is None:
        raise InputError(opt, f"{text!r}: give a rate (examples: 1gbit, 10gbit)")
    return bps


def _creatable(opt: str, directory: str, target: str, writable: bool = True) -> None:
    """`directory` exists as a writable directory, or could be made: its nearest existing ancestor is one.

    Checks only; creates nothing (a job refused here leaves no directory behind).
    """
    probe = directory
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise InputError(opt, f"cannot write {target}: {probe} is not a directory")
    if writable and not os.access(probe, os.W_OK | os.X_OK):
        raise InputError(opt, f"cannot write {target}: {probe} is not writable")


def output_file(args, *names: str, replaced: bool = False) -> None:
    """Paths a job will write: not a directory, writable if present, in a directory that exists or can be made.

    replaced: the job writes a temp file and renames it over the path (checkpoints), so an existing
    path must be a regular file: renaming over a device or a pipe would replace it.
    """
    for opt, path in _values(args, names):
        if not path:
            raise InputError(opt, "empty path")
        if os.path.isdir(path):
            raise InputError(opt, f"{path} is a directory; give a file path")
        if os.path.lexists(path):
            if replaced and not os.path.isfile(path):
                raise InputError(opt, f"{path} exists and is not a regular file")
            if not os.access(path, os.W_OK):
                raise InputError(opt, f"{path} is not writable")
        _creatable(opt, os.path.dirname(os.path.abspath(path)), path)


def output_dir(args, *names: str, writable: bool = True) -> None:
    """Directories a job creates or fills: a directory already, or one that can be made.

    writable=False for caches that fall back to the source when they cannot write (only a path that can
    never be a directory is refused).
    """
    for opt, path in _values(args, names):
        if not path:
            raise InputError(opt, "empty path")
        if os.path.lexists(path) and not os.path.isdir(path):
            raise InputError(opt, f"{path} exists and is not a directory")
        _creatable(opt, os.path.abspath(path), path, writable)


def existing_dir(args, *names: str) -> None:
    """Inputs that must be there already: a dataset, a cache to inspect."""
    for opt, path in _values(args, names):
        if not os.path.exists(path):
            raise InputError(opt, f"{path} does not exist")
        if not os.path.isdir(path):
            raise InputError(opt, f"{path} is not a directory")


def runnable(opt: str, cmd: list[str]) -> None:
    """The program `cmd` starts (its first word, as mpiexec and the shell resolve it) exists and is executable.

    Checked before launching: mpiexec would print its own `execvp error` lines, one per rank, and exit 255.
    """
    word = cmd[0]
    if os.sep not in word:
        if shutil.which(word) is None:
            raise InputError(opt, f"{word}: no such command (not found on PATH)")
        return
    if not os.path.exists(word):
        raise InputError(opt, f"{word}: no such command")
    if os.path.isdir(word) or not os.access(word, os.X_OK):
        raise InputError(opt, f"{word}: not an executable file")


def launched_ranks() -> int:
    """Ranks the launcher started (mpiexec, Open MPI, srun), from its environment: without starting MPI."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 1


DEVICES = ("cpu", "cuda")


def add_device_argument(p: argparse.ArgumentParser) -> None:
    """--device cpu|cuda, checked by check_device."""
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="where each rank trains: cpu, or cuda (rank i on GPU local_rank %% GPUs; ranks may share "
                        "one; default cpu)")


def check_device(args) -> None:
    """--device cuda needs a GPU torch can see: one line naming the torch build, not a traceback at model.to().

    Last in a check: it imports torch, paid only when cuda is asked.
    """
    if args.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else \
            f"built for CUDA {torch.version.cuda}; check the driver and CUDA_VISIBLE_DEVICES"
        raise InputError("--device", f"cuda asked, but torch {torch.__version__} sees no CUDA device ({build})")


def _agree(problem: str | None) -> tuple[str | None, int]:
    """(the problem of any rank, or None; this rank): every rank checked, all must stop if one found a problem.

    Checks of paths can differ between nodes; a rank that stopped alone would leave the others waiting
    for it in MPI's start-up. Plain mpi4py: mpicomm would import torch before the first line of output.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    by_problem: dict[str, list[int]] = {}
    for r, p in enumerate(comm.allgather(problem)):
        if p is not None:
            by_problem.setdefault(p, []).append(r)
    if not by_problem:
        return None, comm.Get_rank()
    if len(by_problem) == 1 and len(next(iter(by_problem.values()))) == comm.Get_size():
        return next(iter(by_problem)), comm.Get_rank()
    return "; ".join(f"{p} (rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))})"
                     for p, rs in by_problem.items()), comm.Get_rank()


def parse(parser: argparse.ArgumentParser, argv=None, check: Callable | None = None, mpi: bool = False):
    """parser.parse_args(argv), then check(args), which raises InputError; on a problem, one line and exit 2.

    mpi: an MPI job. Launched on several ranks, every rank checks and they agree before going on,
    so that all stop together and rank 0 alone prints the line.
    """
    problem = None
    try:
        args = parser.parse_args(argv)
        if check is not None:
            check(args)
    except InputError as exc:
        args, problem = None, str(exc)
    rank = 0
    if mpi and launched_ranks() > 1:
        problem, rank = _agree(problem)
    if problem is None:
        return args
    if rank == 0:
        print(f"error: {problem}", file=sys.stderr, flush=True)
    sys.exit(2)


def add_cluster_bench_arguments(p: argparse.ArgumentParser, default_bandwidths: str) -> None:
    """A cluster benchmark's --bandwidths, --local, --timeout, --json, --plot (checked by cluster_bench_outputs)."""
    p.add_argument("--bandwidths", "--bandwidth", help=f"per-host link rates; none = unshaped (default "
                                                     f"{default_bandwidths}; not with --local)")
    p.add_argument("--congestion-control", metavar="NAME",
                   help="the emulated hosts' TCP congestion control, cubic say (default: this machine's)")
    add_run_arguments(p)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """A cluster benchmark's --local, --timeout, --json, --plot (checked by bench_outputs)."""
    p.add_argument("--local", action="store_true", help="no namespaces: run on this host, unshaped")
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed per worker run (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="write the rows and the run's metadata here (default: none)")
    p.add_argument("--plot", metavar="PNG", help="default: the JSON path with .png")


def bench_outputs(args) -> None:
    """--timeout, and --json/--plot: writable, the PNG beside the JSON by default."""
    positive(args, "timeout")
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "plot")


def cluster_bench_outputs(args, default_bandwidths: str) -> None:
    """A cluster benchmark's bench_outputs and --local/--bandwidths/--hosts.

    Last in a check: the cluster's own limits come from mpicomm, which imports torch and starts MPI.
    """
    bench_outputs(args)
    if args.local:
        if args.bandwidths is not None:
            raise InputError("--bandwidths", "--local runs unshaped on this host, with no links to shape: "
                                             "drop --bandwidths or --local")
        if args.congestion_control is not None:
            raise InputError("--congestion-control", "--local runs on this host's own TCP, with no emulated hosts: "
                                                     "drop --congestion-control or --local")
        return
    from mpicomm.emulation import EmulationError, parse_bandwidth
    from mpicomm.emulation.netns import MAX_HOSTS

    between(args, 1, MAX_HOSTS, "hosts")
    args.bandwidths = comma_list("--bandwidths", args.bandwidths or default_bandwidths)
    for bw in args.bandwidths:
        try:
            parse_bandwidth(bw)
        except EmulationError as exc:
            raise InputError("--bandwidths", str(exc)) from None
    congestion_control_name(args)


def congestion_control_name(args) -> None:
    """--congestion-control, where given, names a kernel algorithm (mpicomm.emulation; it imports torch)."""
    if args.congestion_control is None:
        return
    from mpicomm.emulation import EmulationError
    from mpicomm.emulation.netns import check_congestion_control

    try:
        check_congestion_control(args.congestion_control)
    except EmulationError as exc:
        raise InputError("--congestion-control", str(exc)) from None
