"""One HDF5 shard of preprocessed samples: atomic writing, a JSON manifest, per-sample checksums, locking."""

# The public interface; the code lives in shard_format (what writer and reader share), shard_writer and shard_reader.

from .shard_format import (FORMAT_VERSION, REASONS, ShardError, ShardLockBusy, check_writable, manifest_path,
                           shard_lock)
from .shard_reader import ShardReader
from .shard_writer import ShardWriter

__all__ = ["FORMAT_VERSION", "REASONS", "ShardError", "ShardLockBusy", "ShardReader", "ShardWriter",
           "check_writable", "manifest_path", "shard_lock"]
