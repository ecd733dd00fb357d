"""The cache as a torch Dataset plus batch sampler, for DataLoader workers (HDF5 opened lazily in each worker)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, Sampler

from .cache import SampleCache
from .partition import epoch_batches
from .shard import ShardError


class CachedDataset(Dataset):
    """Item p is this rank's sample at position p: from the shard when the cache is warm, else decoded.

    Pickled to each DataLoader worker without any open file: the shard
    reader reopens its HDF5 file on first use in the worker (serial HDF5
    handles must not cross fork or pickle). The memory level stays in the
    main process's `SampleCache.batches`: copying it into every worker
    would multiply its size by the number of workers. Labels come from
    the cache's copy, checked when it opened the shard.

    A sample that fails its checksum is decoded from the source, and so is
    everything this worker serves after it. A worker cannot invalidate the
    shard for the main process: `SampleCache.batches` does, and rebuilds it,
    when it reads the damage itself.

    For a GPU, batches are best handed over pinned and non-blocking: a
    DataLoader with pin_memory=True, then `.to(device, non_blocking=True)`,
    or (as jobs.train does with `SampleCache.batches`) runtime.data.DeviceFeed.
    """

    def __init__(self, cache: SampleCache):
        self.ids = cache.ids
        self.source, self.pipeline = cache.source, cache.pipeline
        self.reader, self.labels = cache.reader, cache._labels
        self.shard_pos = cache._shard_pos

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, p: int):
        if self.reader is not None and self.shard_pos[p] >= 0:
            sp = int(self.shard_pos[p])
            try:
                return torch.from_numpy(self.reader.read([sp])[0]), int(self.labels[sp])
            except ShardError:
                self.reader = None
        i = int(self.ids[p])
        return torch.from_numpy(self.pipeline.apply(self.source.raw(i), self.source.name(i))), self.source.label(i)


class EpochBatchSampler(Sampler):
    """The same batches as `SampleCache.batches` (this rank's part, reshuffled per epoch, equal step count)."""

    def __init__(self, cache: SampleCache, batch_size: int, epoch: int = 0, shuffle_seed: int | None = None):
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
