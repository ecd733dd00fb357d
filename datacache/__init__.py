"""datacache: preprocessed training samples cached in node-local HDF5 shards and memory, prefetched while the model computes."""

from .cache import CacheStats, SampleCache
from .dataset import CachedDataset, EpochBatchSampler
from .pipeline import Pipeline
from .sources import open_source

__all__ = ["CacheStats", "CachedDataset", "EpochBatchSampler", "Pipeline", "SampleCache", "open_source"]
