"""A shard changed on disk while its samples were served from memory: found at the end of an epoch, then rewritten."""

from __future__ import annotations

import os

import numpy as np

from .shard import ShardError, ShardReader, ShardWriter, manifest_path, shard_lock

_BLOCK_BYTES = 32 << 20  # samples rewritten per piece


def identity(path: str) -> tuple | None:
    """What changes whenever the shard or its manifest is written, replaced or truncated (ctime: even a write
    that puts the old mtime back); None if either is gone. Two stat calls: cheap enough for every epoch."""
    try:
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
                     for s in (os.stat(path), os.stat(manifest_path(path))))
    except FileNotFoundError:
        return None


def damage(path: str, meta: dict) -> str | None:
    """Why the shard on disk is no longer servable (as a new job would open it: manifest, size, ids, labels, every
    sample's checksum), or None if it still is (touched, or replaced by another job's sound rebuild)."""
    try:
        with ShardReader(path, meta) as fresh:
            bad = fresh.verify()
    except (ShardError, OSError) as exc:
        return f"{getattr(exc, 'reason', 'unreadable')}: {exc}"
    return f"checksum mismatch at position(s) {bad[:10]}" if bad else None


def rewrite(path: str, meta: dict, reader: ShardReader, labels: np.ndarray, memory: np.ndarray | None) -> None:
    """A new shard from the copies this process verified: the samples held in `memory` (shard positions
    [0, len(memory))), the others read again through `reader` (checksums verified: a bad one raises ShardError),
    the ids and `labels` checked when the shard was opened. Written as every shard is (temp file, rename,
    manifest last), under the shard's lock; ShardLockBusy if another job holds it."""
    n, held = len(reader), 0 if memory is None else len(memory)
    ids = reader.ids  # read and checked at open: kept by the reader, not read from the damaged file again
    step = max(1, _BLOCK_BYTES // max(1, reader.sample_bytes))
    m = reader.manifest
    with shard_lock(path, blocking=False):
        writer = ShardWriter(path, reader.sample_shape, reader.dtype, meta, compression=m.get("compression"),
                             chunk_samples=m.get("chunk_samples"))
        try:
            for s in range(0, n, step):
                pos = np.arange(s, min(n, s + step))
                in_memory = pos < held
                x = np.empty((len(pos), *reader.sample_shape), reader.dtype)
                if in_memory.any():
                    x[in_memory] = memory[pos[in_memory]]
                if not in_memory.all():
                    x[~in_memory] = reader.read(pos[~in_memory])
                writer.append_many(ids[pos], labels[pos], x)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
