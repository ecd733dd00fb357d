"""jobs.train's data: the training and test sets, the training set through datacache, an epoch's batches, scoring."""

from __future__ import annotations

import sys


def load_data(args, rank):
    """(train inputs, train targets, test inputs, test targets); inputs are tuples of tensors: model(*inputs)."""
    import torch

    from datacache.idx import load_fashion_mnist
    from runtime.workloads import data as D
    from runtime.workloads.models import input_shape, model_input

    if args.data == "austen":
        from datacache.austen import CharCorpus, load_austen_text

        corpus = CharCorpus(load_austen_text())
        (x, y), (tx, ty) = corpus.tensors("train"), corpus.tensors("val")
        return (x,), y, (tx,), ty
    if args.data == "synthetic" and getattr(args, "compute", "real") != "real":
        # An emulated model never reads its inputs: one batch per rank stands for the synthetic set (VGG-19's
        # 224x224 images would fill gigabytes per rank), and nothing is scored (see batch_plan).
        x, y = model_input(args.model, args.batch_size, args.seed + rank)
        return x, y, None, None
    if args.data == "synthetic":
        # The test samples must come from the training set's distribution: the same seed (the
        # class prototypes are drawn first), the tail of a larger draw. A second seed gave the
        # classes other centres, and test accuracy sat at chance.
        n = args.synthetic_samples
        x, y = model_input(args.model, n, args.seed)
        txs, tys = model_input(args.model, n + max(256, n // 8), args.seed)
        return x, y, tuple(t[n:] for t in txs), tys[n:]
    shape = input_shape(args.model)
    txs, tys = load_fashion_mnist("test")
    test = (D.to_tensor(txs, shape),), torch.as_tensor(tys)
    if args.cache_dir:  # the training set comes through the cache
        return (None, None, *test)
    xs, ys = load_fashion_mnist("train")
    return (D.to_tensor(xs, shape),), torch.as_tensor(ys), *test


def too_few_samples(args, samples: int, ranks: int) -> str | None:
    """Why `samples` training samples give not one step of --batch-size (None when they do): the global batch is
    --batch-size x the ranks (a pipeline's: x its --replicas). Synthetic sets are counted by check_args before MPI
    starts, a dataset once loaded, before the optimizer starts a thread (a ValueError from BatchPlan came later,
    as a traceback, with p3's progress thread left running). Through --cache-dir every rank gets a step anyway."""
    per = "replica" if args.parallel == "pipeline" else "rank"
    ranks = args.replicas if args.parallel == "pipeline" else ranks
    if samples >= args.batch_size * ranks:
        return None
    return (f"{samples} training samples are fewer than one global batch ({args.batch_size} per {per} x {ranks} "
            f"{per}s = {args.batch_size * ranks})")


def open_cache(args, rank, ranks):
    """The training set through datacache: Fashion-MNIST's preprocessing, this rank's part."""
    from datacache import Pipeline, SampleCache, open_source
    from datacache.sources import IdxSource

    source = open_source(args.data_dir, "train") if args.data_dir else IdxSource.fashion_mnist("train")
    # One fixed partition (seed 0) whatever --seed is: a sweep over seeds reuses the same shards.
    return SampleCache(source, Pipeline.fashion_mnist(), args.cache_dir, rank, ranks,
                       memory_bytes=args.cache_memory_mb << 20, seed=0,
                       log=lambda text: print(text, file=sys.stderr, flush=True))


def example_inputs(args, x) -> tuple:
    """What the model is called with each step, for emulated compute to trace: one batch of the training inputs
    (of the cache's preprocessed shape when they come through datacache)."""
    if x is None:
        import torch

        from runtime.workloads.models import input_shape

        return (torch.zeros(args.batch_size, *input_shape(args.model)),)
    return tuple(t[:args.batch_size] for t in x)


def batch_plan(args, x, ranks: int, rank: int):
    """Which samples each step takes: runtime.workloads.data.BatchPlan, or under emulated compute on synthetic
    data (one batch per rank, load_data) that batch every step, as many steps as the set would give."""
    from runtime.workloads.data import BatchPlan

    if args.data == "synthetic" and getattr(args, "compute", "real") != "real":
        return RepeatedBatch(args.synthetic_samples, args.batch_size, ranks)
    return BatchPlan(len(x[0]), args.batch_size, ranks, rank, args.seed)


class RepeatedBatch:
    """BatchPlan's part for a rank holding one batch: every step of every epoch takes all of it."""

    def __init__(self, num_samples: int, local_batch: int, ranks: int):
        import numpy as np

        if num_samples < local_batch * ranks:
            raise ValueError(f"dataset of {num_samples} samples is smaller than one global batch "
                             f"({local_batch} per rank x {ranks} ranks = {local_batch * ranks})")
        self.steps, self.idx = num_samples // (local_batch * ranks), np.arange(local_batch)

    def __len__(self) -> int:
        return self.steps

    def epoch(self, e: int) -> list:
        return [self.idx] * self.steps


def train_batches(args, epoch, steps, x, y, plan, cache, shape, feed):
    """This epoch's (inputs, target) batches on the training device: from the in-memory arrays, or read ahead
    through the cache; `feed` (runtime.device.DeviceFeed) hands them over (pinned, non-blocking on a GPU)."""
    from runtime.workloads.data import fit_to_shape

    if cache is None:
        for idx in plan.epoch(epoch)[:steps]:
            *inputs, target = feed.take((*x, y), idx)
            yield tuple(inputs), target
        return
    # Leaving early (--max-steps, an error) closes the read-ahead thread.
    with cache.batches(epoch, args.batch_size, args.prefetch, shuffle_seed=args.seed) as ahead:
        for _, (xb, yb) in zip(range(steps), ahead):
            xb, yb = feed((fit_to_shape(xb, shape), yb))
            yield (xb,), yb


def evaluate(model, x, y, comm, feed, batch=512):
    """(accuracy, targets scored) over the test set, each rank scoring a 1/P share (tokens for the transformer)."""
    import numpy as np
    import torch

    P, r = comm.Get_size(), comm.Get_rank()
    idx = np.array_split(np.arange(len(x[0])), P)[r]
    correct = torch.zeros((), dtype=torch.int64, device=feed.device)  # summed where computed: no wait per batch
    total = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for a in range(0, len(idx), batch):
            *inputs, target = feed.take((*x, y), idx[a:a + batch])
            correct += (model(*inputs).argmax(-1) == target).sum()
            total += target.numel()
    model.train(was_training)
    counts = np.array([int(correct), total], dtype=np.int64)
    comm.Allreduce(np.copy(counts), counts)
    return counts[0] / max(1, counts[1]), int(counts[1])
