"""The cache as a torch Dataset plus batch sampler: DataLoader workers read, and hand over, whole batches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate, get_worker_info

from .cache import SampleCache
from .partition import epoch_batches, steps_per_epoch
from .pipeline import check_shape
from .shard import ShardError
from .sources import UnreadableSample


class Batch(Sequence):
    """A batch read at once: `inputs` (n, *sample shape) and `labels` (n,) tensors.

    `collate` passes it through as (inputs, labels). As a sequence of
    (sample, label) pairs it also suits torch's default collate, which
    stacks it again, as it would single samples.
    """

    __slots__ = ("inputs", "labels")

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor):
        self.inputs, self.labels = inputs, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, k: int):
        return self.inputs[k], int(self.labels[k])


def collate(batch):
    """collate_fn for a DataLoader over a CachedDataset: a `Batch` as (inputs, labels), anything else as torch's
    default collate would."""
    if isinstance(batch, Batch):
        return batch.inputs, batch.labels
    return default_collate(batch)


def _batch_tensors(n: int, shape: tuple, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized (inputs, int64 labels) tensors for n samples of `shape` and numpy `dtype`.

    In a DataLoader worker both lie in one shared-memory segment: torch sends
    a tensor to the main process through shared memory anyway (moving one
    that is not there with a copy), and passes each segment as a file
    descriptor over a socket, a round trip the main process pays per segment.
    """
    dtype = torch.from_numpy(np.empty(0, dtype)).dtype
    nbytes = n * int(np.prod(shape)) * dtype.itemsize
    if get_worker_info() is None or n == 0:
        return torch.empty((n, *shape), dtype=dtype), torch.empty(n, dtype=torch.int64)
    at = -(-nbytes // 8)  # the labels, 8-byte aligned, after the inputs (in int64 elements)
    # Allocated in shared memory directly, as torch's default_collate does, not copied there later.
    storage = torch.UntypedStorage._new_shared(8 * (at + n))
    return (torch.empty(0, dtype=dtype).set_(storage, 0, (n, *shape)),
            torch.empty(0, dtype=torch.int64).set_(storage, at, (n,)))


class CachedDataset(Dataset):
    """Item p is this rank's sample at position p: from the shard when the cache is warm, else decoded.

        loader = CachedDataset(cache).loader(batch_size, workers=4)
        for epoch in range(epochs):
            loader.batch_sampler.set_epoch(epoch)
            for x, y in loader: ...          # the batches of cache.batches(epoch, batch_size)

    `loader` is the fast path: each worker reads a whole batch with one
    shard read (`__getitems__`, which torch calls with the batch's
    positions), into one shared-memory tensor that reaches the main
    process without another copy, and `collate` passes it through. A
    DataLoader built by hand gets the same with
    `batch_sampler=EpochBatchSampler(...)` and
    `collate_fn=CachedDataset.collate`; with torch's default collate it
    still works (the batch is read at once, then stacked sample by
    sample), and so does `dataset[p]`.

    Pickled to each DataLoader worker without any open file: the shard
    reader reopens its HDF5 file on first use in the worker (serial HDF5
    handles must not cross fork or pickle). The memory level stays in the
    main process's `SampleCache.batches`: copying it into every worker
    would multiply its size by the number of workers, while a worker's
    read of the node-local shard comes from the page cache. Labels come
    from the cache's copy, checked when it opened the shard.

    A sample that fails its checksum is decoded from the source with the
    rest of its batch, and so is everything this worker serves after it. A
    worker cannot invalidate the shard for the main process:
    `SampleCache.batches` does, and rebuilds it, when it reads the damage
    itself. A sample missing from the shard (unreadable when it was built)
    is decoded again; if it still fails, a batch drops it as
    `SampleCache.batches` does (`dataset[p]` raises). The dataset serves the
    cache as it was when made: make it once the cache is warm.

    For a GPU, batches are best handed over pinned and non-blocking:
    `loader(..., pin_memory=True)`, then `.to(device, non_blocking=True)`,
    or (as jobs.train does with `SampleCache.batches`) runtime.device.DeviceFeed.
    """

    def __init__(self, cache: SampleCache):
        self.ids, self.seed, self.rank, self.ranks = cache.ids, cache.seed, cache.rank, cache.ranks
        self.source, self.pipeline, self.on_error = cache.source, cache.pipeline, cache.on_error
        self.reader, self.labels = cache.reader, cache._labels
        self.shard_pos = cache._shard_pos
        self._shape = cache.reader.sample_shape if cache.reader is not None else cache._sample_shape

    def __len__(self) -> int:
        return len(self.ids)

    def steps(self, batch_size: int) -> int:
        return steps_per_epoch(len(self.source), self.ranks, batch_size)

    def loader(self, batch_size: int, epoch: int = 0, workers: int = 0, shuffle_seed: int | None = None,
               **dataloader_args) -> DataLoader:
        """A DataLoader giving `SampleCache.batches`'s batches, each read and handed over whole.

        Set the epoch with `loader.batch_sampler.set_epoch(e)` before iterating; workers
        persist across epochs unless persistent_workers=False is passed (other arguments:
        torch's, e.g. pin_memory, prefetch_factor, multiprocessing_context).
        """
        dataloader_args.setdefault("persistent_workers", workers > 0)
        return DataLoader(self, batch_sampler=EpochBatchSampler(self, batch_size, epoch, shuffle_seed),
                          num_workers=workers, collate_fn=collate, **dataloader_args)

    collate = staticmethod(collate)

    def __getitem__(self, p: int):
        if self.reader is not None and self.shard_pos[p] >= 0:
            sp = int(self.shard_pos[p])
            try:
                return torch.from_numpy(self.reader.read([sp])[0]), int(self.labels[sp])
            except ShardError:
                self.reader = None
        i = int(self.ids[p])
        return torch.from_numpy(self.pipeline.apply(self.source.raw(i), self.source.name(i))), self.source.label(i)

    def __getitems__(self, positions) -> Batch:
        """The samples at `positions`, in their order: one shard read, or the source when it must."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if self.reader is None:
            return self._decode(pos)
        sp = self.shard_pos[pos]
        stored = sp >= 0
        if not stored.all():
            return self._with_missing(pos, sp, stored)
        x, y = _batch_tensors(len(sp), self._shape, self.reader.dtype)
        try:
            self.reader.read(sp, out=x.numpy())
        except ShardError:
            self.reader = None  # this worker's copy only: the rest of its batches come from the source
            return self._decode(pos)
        np.take(self.labels, sp, out=y.numpy())
        return Batch(x, y)

    def _with_missing(self, pos, sp, stored) -> Batch:
        """A batch holding samples the shard lacks (unreadable when it was built): those are decoded again."""
        try:
            shard = self.reader.read(sp[stored])
        except ShardError:
            self.reader = None
            return self._decode(pos)
        missing = np.flatnonzero(~stored)
        rows = [self._decode_one(p) for p in pos[missing].tolist()]
        keep = stored.copy()
        keep[missing] = [r is not None for r in rows]
        at = np.cumsum(keep) - 1  # each kept sample's row in the batch
        x, y = _batch_tensors(int(keep.sum()), self._shape, self.reader.dtype)
        xs, ys = x.numpy(), y.numpy()
        xs[at[stored]], ys[at[stored]] = shard, self.labels[sp[stored]]
        for k, r in zip(missing.tolist(), rows):
            if r is not None:
                xs[at[k]], ys[at[k]] = r
        return Batch(x, y)

    def _decode_one(self, p: int):
        """(preprocessed sample, label) from the source; None if it cannot be read and the policy skips it."""
        i = int(self.ids[p])
        try:
            x = self.pipeline.apply(self.source.raw(i), self.source.name(i))
            check_shape(x, self._shape if self._shape != (0,) else None, self.source.name(i))  # (0,): unknown
            return x, self.source.label(i)
        except UnreadableSample:
            if self.on_error == "fail":
                raise
            return None

    def _decode(self, pos) -> Batch:
        rows = [r for r in map(self._decode_one, pos.tolist()) if r is not None]
        if rows:
            self._shape = rows[0][0].shape
        x, y = _batch_tensors(len(rows), self._shape, rows[0][0].dtype if rows else np.float32)
        if rows:
            np.stack([r[0] for r in rows], out=x.numpy())
            y.numpy()[:] = [r[1] for r in rows]
        return Batch(x, y)


class EpochBatchSampler(Sampler):
    """The same batches as `SampleCache.batches` (this rank's part, reshuffled per epoch, equal step count).

    `cache`: the SampleCache, or a CachedDataset made from it.
    """

    def __init__(self, cache: SampleCache | CachedDataset, batch_size: int, epoch: int = 0,
                 shuffle_seed: int | None = None):
        self.count, self.steps = len(cache.ids), cache.steps(batch_size)
        self.seed = cache.seed if shuffle_seed is None else shuffle_seed
        self.rank, self.epoch = cache.rank, epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for batch in epoch_batches(self.count, self.steps, self.epoch, self.seed, self.rank):
            yield batch.tolist()

    def __len__(self) -> int:
        return self.steps
