"""Benchmark: data loading through datacache (cold first epoch, warm later ones) vs a plain DataLoader over raw files.

    mpiexec -n 4 mpitrain bench cache --json results/bench-cache.json
    mpiexec -n 4 mpitrain bench cache --source /data/fmnist-png --epochs 3 --workers 4 --rounds 5

Every rank loads its part of the source (as in training, exactly once per
epoch across ranks) and touches every batch; nothing trains, so the figures
are the loading pipeline's own. Configurations, samples/s over all ranks
(total samples / slowest rank's time):
  cache epoch N      SampleCache.batches (read-ahead thread; epoch 1 decodes
                     the source and writes the shards, later epochs read
                     memory and the node-local shards);
  cache + workers    the warm cache through CachedDataset.loader with
                     --workers: each worker reads a whole batch at once and
                     hands it over as one shared-memory tensor;
  ... per sample     the same DataLoader fetching sample by sample (the
                     path without CachedDataset.__getitems__);
  raw DataLoader     torch DataLoader with --workers over the raw files,
                     decoding and preprocessing every sample every epoch.
The three DataLoaders run --rounds epochs each, in a rotating order, and
report the median (their workers persist: started in the first round).
The default source is Fashion-MNIST exported to 70,000 PNG files (made on
first use). Cache size on disk and in memory is reported too.
"""

from __future__ import annotations

import argparse
import os
import time

from jobs.common.inputs import InputError, JobParser, at_least, existing_dir, output_dir, output_file, parse
from jobs.common.outputs import write_results
from jobs.common.report import run_metadata, save_figure

DEFAULT_SOURCE = "/tmp/mpitrain-fmnist-png"


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.cache", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--source", default=DEFAULT_SOURCE, help=f"default {DEFAULT_SOURCE} (exported if missing)")
    p.add_argument("--cache-dir", default="/tmp/mpitrain-bench-cache", help="its shards are removed first (nothing else)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, help="DataLoader workers per rank (all DataLoaders); default: the "
                   "rank's share of this node's cores less one for the rank itself, 1 to 4")
    p.add_argument("--rounds", type=int, default=3,
                   help="epochs timed per DataLoader, interleaved (median reported)")
    p.add_argument("--memory-mb", type=int, default=256)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG", help="default: the JSON path with .png")
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    if args.epochs < 2:
        raise InputError("--epochs", f"must be >= 2 (a cold and a warm epoch), got {args.epochs}")
    at_least(args, 1, "batch_size", "rounds")
    at_least(args, 0, "workers", "memory_mb")
    if args.source == DEFAULT_SOURCE:
        output_dir(args, "source")  # exported there if missing
    else:
        existing_dir(args, "source")
    output_dir(args, "cache_dir")
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "plot")


def timed(comm, loader) -> tuple[float, int]:
    """(slowest rank's seconds, samples over all ranks) to go through `loader`, touching every batch."""
    from mpi4py import MPI

    comm.Barrier()
    t0, n, checksum = time.perf_counter(), 0, 0.0
    for x, _ in loader:
        n += len(x)
        checksum += float(x[:, 0, 0, 0].sum())  # materialize the batch
    mine = time.perf_counter() - t0
    return comm.allreduce(mine, op=MPI.MAX), comm.allreduce(n)


def default_workers(comm) -> int:
    """This rank's share of the node's cores, less one for the rank itself: 1 to 4 workers."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    share = len(os.sched_getaffinity(0)) // node.Get_size()
    node.Free()
    return max(1, min(4, share - 1))


def per_sample_loader(cache, batch_size, epoch, workers):
    """The DataLoader as it was before batched fetches: workers read, and torch stacks, one sample at a time."""
    import torch

    from datacache import CachedDataset, EpochBatchSampler

    class PerSample(CachedDataset):
        __getitems__ = None  # torch then fetches dataset[p] for each position

    return torch.utils.data.DataLoader(PerSample(cache), batch_sampler=EpochBatchSampler(cache, batch_size, epoch),
                                       num_workers=workers, persistent_workers=workers > 0)


def raw_loader(cache, batch_size, workers):
    """A plain DataLoader over the raw files: this rank's part, shuffled, decoded and preprocessed every time."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    class RawFiles(Dataset):
        def __init__(self, source, pipeline, ids):
            self.source, self.pipeline, self.ids = source, pipeline, ids

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, p):
            i = int(self.ids[p])
            return torch.from_numpy(self.pipeline.apply(self.source.raw(i))), self.source.label(i)

    return DataLoader(RawFiles(cache.source, cache.pipeline, cache.ids), batch_size=batch_size, shuffle=True,
                      num_workers=workers, persistent_workers=workers > 0)


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    import torch
    from mpi4py import MPI

    from datacache import CachedDataset, Pipeline, SampleCache, open_source

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    if args.workers is None:
        args.workers = comm.allreduce(default_workers(comm), op=MPI.MIN)  # the same on every rank: one row each
    say = print if rank == 0 else (lambda *a, **k: None)
    if rank == 0:
        if not os.path.exists(os.path.join(args.source, "labels.csv")) and args.source == DEFAULT_SOURCE:
            from datacache.export import export_fashion_mnist

            say(f"# exporting Fashion-MNIST to {args.source} ...", flush=True)
            export_fashion_mnist(args.source, progress=False)
        if os.path.isdir(args.cache_dir):
            # A cold start, without deleting whatever else the directory holds: only the shards go.
            from jobs.cache import clear

            clear(argparse.Namespace(cache_dir=args.cache_dir))
    comm.Barrier()
    source = open_source(args.source)
    cache = SampleCache(source, Pipeline.fashion_mnist(), args.cache_dir, rank, P,
                        memory_bytes=args.memory_mb << 20, log=lambda *a: None)
    rows = []

    def row(config, seconds, samples, **extra):
        rows.append(dict(config=config, ranks=P, workers=args.workers, batch_size=args.batch_size,
                         seconds=seconds, samples=samples, samples_per_s=samples / seconds, **extra))
        say(f"{config:<38} {samples / seconds:>10.0f} samples/s  ({seconds:.2f} s)", flush=True)

    for epoch in range(args.epochs):
        state = cache.state
        with cache.batches(epoch, args.batch_size) as batches:
            row(f"cache epoch {epoch + 1} ({state})", *timed(comm, batches), epoch=epoch + 1, state=state)
    w = args.workers
    loaders = {f"cache + {w} workers (warm)": CachedDataset(cache).loader(args.batch_size, args.epochs, w),
               f"cache + {w} workers, per sample (warm)": per_sample_loader(cache, args.batch_size, args.epochs, w),
               f"raw DataLoader, {w} workers": raw_loader(cache, args.batch_size, w)}
    times = {name: [] for name in loaders}
    for r in range(args.rounds):
        names = list(loaders)
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate: no config always goes first
            sampler = loaders[name].batch_sampler
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(args.epochs + r)
            times[name].append(timed(comm, loaders[name]))
    del loaders  # their workers stop
    for name, runs in times.items():
        rates = [n / t for t, n in runs]
        mid = sorted(runs, key=lambda run: run[1] / run[0])[len(runs) // 2]  # the median round (upper, if even)
        row(name, *mid, rounds=rates)

    disk = comm.allreduce(os.path.getsize(cache.path) if cache.path and os.path.exists(cache.path) else 0)
    memory = comm.allreduce(0 if cache.memory is None else cache.memory.nbytes)
    warm = [r["samples_per_s"] for r in rows if r.get("epoch", 0) >= 2]
    cold, batched, per_sample, raw = (rows[i]["samples_per_s"] for i in (0, -3, -2, -1))
    summary = dict(samples=len(source), cache_disk_bytes=disk, cache_memory_bytes=memory, workers=w,
                   warm_vs_cold=min(warm) / cold, warm_vs_raw_dataloader=min(warm) / raw,
                   workers_batched_vs_per_sample=batched / per_sample)
    say(f"\ncache on disk {disk / 1e6:.1f} MB, in memory {memory / 1e6:.1f} MB (all ranks); "
        f"warm epochs {summary['warm_vs_cold']:.1f}x epoch 1, {summary['warm_vs_raw_dataloader']:.1f}x the raw "
        f"DataLoader with {w} worker(s); through workers, whole batches "
        f"{summary['workers_batched_vs_per_sample']:.1f}x sample by sample (medians of {args.rounds} rounds)")
    cache.close()
    meta = run_metadata("jobs.bench.cache", argv, ranks=P, source=args.source, **summary)
    write_results(comm, args, meta, rows, lambda path: plot(rows, path), say)
    return 0


def plot(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.barh([r["config"] for r in rows][::-1], [r["samples_per_s"] for r in rows][::-1], color="#4c72b0")
    ax.set_xscale("log")
    ax.set_xlabel("samples/s, all ranks (log)")
    ax.set_title(f"loading {rows[0]['samples']} samples per epoch, {rows[0]['ranks']} ranks")
    ax.grid(True, axis="x", alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before torch and MPI start
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
