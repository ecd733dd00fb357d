"""The sample cache from the command line: build it ahead of training, inspect, verify and clear it.

    mpiexec -n 4 mpitrain cache warm --source /data/fmnist-png --cache-dir /tmp/mpitrain-cache
    mpitrain cache info   --cache-dir /tmp/mpitrain-cache
    mpitrain cache verify --cache-dir /tmp/mpitrain-cache [--remove-bad]
    mpitrain cache clear  --cache-dir /tmp/mpitrain-cache [--wait 60]
    mpitrain cache export --out /data/fmnist-png          # Fashion-MNIST as 70,000 PNG files

warm builds, on every rank, the shard of the part that rank will train on
(run it with the same number of ranks as the training job, from the same
source: the source's fingerprint, the rank count and the partition seed name
the shards; the cache directory should be node-local). The preprocessing is
the Fashion-MNIST preset unless --mode/--resize/--crop/--mean/--std/--dtype
say otherwise; its hash names the shards too, so a changed pipeline builds new
ones. `mpitrain train` reads shards of the preset and seed 0 only: the other
settings serve a job of your own (datacache.SampleCache with that pipeline).
Errors print one line and exit 2 (under mpiexec, on every rank together).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from jobs.common.inputs import InputError, JobParser, at_least, existing_dir, output_dir, parse
from jobs.common.outputs import write_together


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.cache", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    warm = sub.add_parser("warm", help="build this rank's shard (under mpiexec/srun: every rank's)")
    warm.add_argument("--source", required=True, help="image folder, labels.csv folder or Fashion-MNIST IDX dir")
    warm.add_argument("--split", choices=("train", "test"), default="train", help="for IDX sources: train or test")
    add_pipeline_args(warm)
    warm.add_argument("--seed", type=int, default=0,
                      help="partition seed, your SampleCache's (default 0: the one mpitrain train uses)")
    warm.add_argument("--on-error", choices=("skip", "fail"), default="skip",
                      help="an unreadable sample: skip it (default) or stop every rank")
    info = sub.add_parser("info", help="list the shards, their size and what they hold")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    verify = sub.add_parser("verify", help="check every sample's checksum")
    verify.add_argument("--remove-bad", action="store_true", help="delete shards that fail")
    clear = sub.add_parser("clear", help="remove every shard")
    clear.add_argument("--wait", type=float, default=60.0,
                       help="seconds to wait for a shard that a writer holds before leaving it (default 60)")
    for q in (info, verify, clear):
        q.add_argument("--cache-dir", required=True)
    export = sub.add_parser("export", help="write Fashion-MNIST (IDX) as 70,000 PNG files + labels.csv")
    export.add_argument("--out", required=True)
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    if args.cmd == "export":
        output_dir(args, "out")
        return
    if args.cmd != "warm":
        existing_dir(args, "cache_dir")
        if args.cmd == "clear":
            at_least(args, 0, "wait")
        return
    at_least(args, 0, "seed")
    at_least(args, 1, "resize", "crop")
    existing_dir(args, "source")
    output_dir(args, "cache_dir")
    if any(getattr(args, k) is not None for k in PIPELINE_OPTIONS):
        try:
            pipeline_from(args)  # the pipeline's own checks: channels of mean/std, uint8 not normalized...
        except ValueError as exc:
            raise InputError("/".join(f"--{k}" for k in PIPELINE_OPTIONS), str(exc)) from None


def add_pipeline_args(p) -> None:
    """The cache directory and the preprocessing (datacache.Pipeline's arguments; unset: the preset)."""
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--mode", choices=("L", "RGB"), help="default: the Fashion-MNIST preset (and the rest with it)")
    p.add_argument("--resize", type=int, help="shorter side to this many pixels")
    p.add_argument("--crop", type=int, help="centre crop to this square")
    p.add_argument("--mean", type=float, nargs="+", help="per channel, after scaling to [0, 1]")
    p.add_argument("--std", type=float, nargs="+", help="per channel")
    p.add_argument("--dtype", choices=("float32", "float16", "uint8"), help="what the shard stores")


PIPELINE_OPTIONS = ("mode", "resize", "crop", "mean", "std", "dtype")


def pipeline_from(args):
    from datacache.pipeline import Pipeline

    custom = {k: getattr(args, k) for k in PIPELINE_OPTIONS if getattr(args, k, None) is not None}
    return Pipeline(**custom) if custom else Pipeline.fashion_mnist()


def shards(cache_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(cache_dir, "*.h5")))


def warm(args) -> int:
    from mpi4py import MPI

    from datacache import SampleCache
    from datacache.sources import UnreadableSample, open_source
    from mpicomm.agree import fail_together

    comm = MPI.COMM_WORLD
    cache, problem = None, None
    try:
        source = open_source(args.source, args.split)
        cache = SampleCache(source, pipeline_from(args), args.cache_dir, comm.Get_rank(), comm.Get_size(),
                            memory_bytes=0, on_error=args.on_error, seed=args.seed)
        was = cache.state
        cache.warm()
    except (ValueError, OSError, UnreadableSample) as exc:  # a rank's own data or disk: said by every rank
        problem = str(exc)
    try:
        # A rank that returned alone would leave the others in the allgather below for good.
        fail_together(comm, problem, WarmError)
        states = comm.allgather((cache.rank, was, cache.state, len(cache.ids), len(cache.stats.skipped),
                                 cache.path, cache.disabled))
    finally:
        if cache is not None:
            cache.close()
    if comm.Get_rank() == 0:
        for rank, before, after, n, skipped, path, disabled in states:
            print(f"rank {rank}: {n} samples, {before} -> {after}{_why_not(after, n, skipped, disabled)}, "
                  f"{skipped} skipped: {path}")
    return 0 if all(s[2] == "warm" for s in states) else 1


def _why_not(state: str, samples: int, skipped: int, disabled: str | None) -> str:
    """Why a rank's shard is not warm after warm(), as the line about it says."""
    if state == "warm":
        return ""
    if disabled:
        return f" ({disabled})"
    if not samples:
        return " (no sample of its own: more ranks than samples)"
    return " (every sample skipped)" if skipped == samples else ""


class WarmError(ValueError):
    """A rank could not build its shard; raised on every rank, naming each rank's reason."""


def info(args) -> int:
    rows = []
    for path in shards(args.cache_dir):
        row = dict(shard=os.path.basename(path), bytes=os.path.getsize(path))
        try:
            with open(path + ".json") as f:
                manifest = json.load(f)
            row.update(samples=manifest.get("count"), meta=manifest.get("meta"))
        except (OSError, ValueError) as exc:
            row.update(problem=f"no readable manifest ({exc.__class__.__name__}): incomplete or foreign")
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    total = sum(r["bytes"] for r in rows)
    for r in rows:
        print(f"{r['shard']}  {r['bytes'] / 1e6:8.1f} MB  {r.get('samples', '?')} samples  {r.get('problem', '')}")
    print(f"{len(rows)} shard(s), {total / 1e6:.1f} MB in {args.cache_dir}")
    return 0


def verify(args) -> int:
    from datacache.shard import ShardError, ShardReader

    bad = 0
    for path in shards(args.cache_dir):
        try:
            reader = ShardReader(path)  # its own errors name the shard or manifest and what is wrong
            try:
                broken = reader.verify()
            finally:
                reader.close()
            problem = f"{len(broken)} corrupt sample(s) at positions {broken[:5]}" if broken else None
        except (OSError, ValueError, KeyError, ShardError) as exc:
            problem = str(exc)
        print(f"{os.path.basename(path)}: {problem or 'ok'}")
        if problem:
            bad += 1
            if args.remove_bad:
                print(f"  {_remove_locked(path)}")
    return 1 if bad else 0


def _remove_locked(path: str) -> str:
    """Remove a shard and its manifest under its lock, never from under a writer between its renames."""
    from datacache.shard import shard_lock

    try:
        with shard_lock(path, blocking=False):
            for p in (path, path + ".json"):
                if os.path.exists(p):
                    os.remove(p)
        return "removed"
    except TimeoutError as exc:
        return f"not removed: a writer holds it ({exc})"


def clear(args) -> int:
    from datacache.shard import shard_lock

    removed, busy = 0, []
    for path in shards(args.cache_dir):
        try:
            lock = _take_lock(path, args.wait)  # never pulled from under its writer
        except TimeoutError as exc:
            busy.append(f"{os.path.basename(path)} ({exc})")
            continue
        try:
            for p in (path, path + ".json"):
                if os.path.exists(p):
                    os.remove(p)
                    removed += 1
        finally:
            lock.__exit__(None, None, None)
    # Temp files of writers that were killed: ".<shard>.tmp.<pid>.<hex>" and the manifest's
    # ".<shard>.json.tmp.<pid>.<hex>", both under the shard's lock; a live writer holds it.
    for tmp in glob.glob(os.path.join(args.cache_dir, ".*.tmp.*")):
        name = os.path.basename(tmp)[1:].split(".tmp.")[0]
        shard = os.path.join(args.cache_dir, name[:-len(".json")] if name.endswith(".json") else name)
        try:
            with shard_lock(shard, blocking=False):
                os.remove(tmp)
                removed += 1
        except (TimeoutError, FileNotFoundError):
            pass
    print(f"removed {removed} file(s) from {args.cache_dir}")
    if busy:
        print(f"error: {len(busy)} shard(s) left, their writers still at work: {'; '.join(busy)}", file=sys.stderr)
        return 1
    return 0


def _take_lock(path: str, seconds: float):
    """The shard's lock, entered: at once, or after up to `seconds` for a writer that holds it (said first)."""
    from datacache.shard import shard_lock

    lock = shard_lock(path, blocking=False)
    try:
        lock.__enter__()
        return lock
    except TimeoutError:
        if not seconds:
            raise
        print(f"waiting up to {seconds:g} s for the writer of {os.path.basename(path)}", flush=True)
    lock = shard_lock(path, timeout=seconds)
    lock.__enter__()
    return lock


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    if args.cmd == "export":
        from datacache.export import export_fashion_mnist

        write_together(None, "--out", args.out,
                       lambda: print(f"wrote {export_fashion_mnist(args.out)} images to {args.out}"))
        return 0
    try:
        return {"warm": warm, "info": info, "verify": verify, "clear": clear}[args.cmd](args)
    except WarmError as exc:  # every rank has it, naming every rank's reason: said once
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before MPI starts
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
