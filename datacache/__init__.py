"""datacache: preprocessed training samples cached in node-local HDF5 shards and memory, prefetched while the model computes."""

from .cache import CacheStats, SampleCache
from .pipeline import Pipeline
from .sources import open_source

__all__ = ["CacheStats", "CachedDataset", "EpochBatchSampler", "Pipeline", "SampleCache", "open_source"]


def __getattr__(name: str):
    # The torch Dataset classes load torch (~1.3 s a process) when first asked for: `mpitrain cache` (warm, info,
    # verify, clear) and the cache's own tests never need it.
    if name in ("CachedDataset", "EpochBatchSampler"):
        from . import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # dir() and completion list the lazy names too (PEP 562), without loading them.
    return sorted(set(globals()) | set(__all__))
