"""ShardWriter: writes one shard atomically (temp file, fsync, rename, then the manifest)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
import zlib

import numpy as np

from .shard_format import FORMAT_VERSION, _SMALL, _crcs, _fsync_dir, _temp_name, _write_error, manifest_path

# Measured on 60k float32 (1, 28, 28): 64-256 samples per chunk write equally fast, and reads bypass
# HDF5's chunk machinery (see ShardReader), so the size only has to stay under HDF5's 1 MiB chunk cache.
_CHUNK_SAMPLES, _MAX_CHUNK_BYTES = 128, 1 << 20
_SMALL_CHUNK = 8192     # ids, labels, checksums
_META_MARGIN = 1 << 20  # disk reserved beyond the sample bytes for HDF5's own index and heaps


class ShardWriter:
    """Writes a temp file; commit() renames it into place, then writes the manifest, which marks it complete.

    Leaving the `with` block normally commits; an exception aborts (removes the temp file).
    """

    def __init__(self, path, sample_shape, dtype, meta: dict, *, compression=None, chunk_samples=None):
        self.path = os.fspath(path)
        self.sample_shape, self.dtype = tuple(int(d) for d in sample_shape), np.dtype(dtype)
        if self.dtype.kind not in "biuf" or min(self.sample_shape, default=1) < 1:
            raise ValueError(f"shard {self.path}: need a numeric dtype and positive sample dimensions, "
                             f"got {self.dtype} {self.sample_shape}")
        if compression not in (None, "lzf"):
            raise ValueError(f"compression must be None or 'lzf', got {compression!r}")
        try:
            self.meta = json.loads(json.dumps(meta))
        except (TypeError, ValueError) as e:
            raise TypeError(f"shard {self.path}: meta must be JSON-serialisable ({e})") from None
        self.compression = compression
        self.sample_bytes = int(np.prod(self.sample_shape)) * self.dtype.itemsize
        n = chunk_samples or max(1, min(_CHUNK_SAMPLES, _MAX_CHUNK_BYTES // self.sample_bytes))
        self.chunk_samples = n = int(n)
        self.tmp_path, self.count = _temp_name(self.path), 0
        self._buf = np.empty((n, *self.sample_shape), self.dtype)
        self._buf_ids, self._buf_labels, self._nbuf = np.empty(n, np.int64), np.empty(n, np.int64), 0
        self._crc = dict.fromkeys(_SMALL, 0)  # running crc32 of each small dataset, for the manifest
        self._pending, self._small_count = {name: [] for name in _SMALL}, 0
        self._file, self._fd, self._reserved, self._state = None, None, 0, "open"
        with self._io("create a temporary file"):
            # os.open first: its errors carry errno (h5py's often do not), and O_EXCL guards the name.
            self._fd = os.open(self.tmp_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            # The temp file is private to this writer: HDF5's own file lock would only add failure modes.
            import h5py  # here, as in shard_reader: only a job that writes a shard pays its import

            self._file = f = h5py.File(self.tmp_path, "w", locking=False)
            shape = self.sample_shape
            self._samples = f.create_dataset("samples", shape=(0, *shape), maxshape=(None, *shape), chunks=(n, *shape),
                                             dtype=self.dtype, compression=compression)
            for name, dt in _SMALL.items():
                f.create_dataset(name, shape=(0,), maxshape=(None,), chunks=(_SMALL_CHUNK,), dtype=dt)

    @contextlib.contextmanager
    def _io(self, what: str):
        try:
            yield
        except (OSError, RuntimeError) as e:  # h5py reports some failed writes as RuntimeError
            self.abort()
            raise _write_error(e, what, self.path) from e

    def _check(self, a: np.ndarray, shape: tuple) -> None:
        if self._state != "open":
            raise RuntimeError(f"shard writer for {self.path} is {self._state}")
        if a.shape != shape:
            raise ValueError(f"shard {self.path}: got samples of shape {a.shape}, expected {shape}")
        if not np.can_cast(a.dtype, self.dtype, "same_kind"):  # e.g. floats into uint8 would wrap silently
            raise TypeError(f"shard {self.path}: cannot store {a.dtype} samples as {self.dtype}")

    def append(self, sample_id: int, label: int, array) -> None:
        """Add one sample (buffered: HDF5 is written a whole chunk at a time)."""
        a = np.asarray(array)
        self._check(a, self.sample_shape)
        i = self._nbuf
        self._buf[i], self._buf_ids[i], self._buf_labels[i] = a, sample_id, label
        self._nbuf += 1
        if self._nbuf == self.chunk_samples:
            self._flush()

    def append_many(self, ids, labels, arrays) -> None:
        """Add a batch: arrays (k, *sample_shape), ids and labels of length k."""
        a, ids, labels = np.asarray(arrays), np.asarray(ids, np.int64).ravel(), np.asarray(labels, np.int64).ravel()
        self._check(a, (len(ids), *self.sample_shape))
        if len(labels) != len(ids):
            raise ValueError(f"shard {self.path}: {len(ids)} ids but {len(labels)} labels")
        i = 0
        while i < len(a):
            j, k = self._nbuf, min(self.chunk_samples - self._nbuf, len(a) - i)
            self._buf[j:j + k], self._buf_ids[j:j + k], self._buf_labels[j:j + k] = \
                a[i:i + k], ids[i:i + k], labels[i:i + k]
            self._nbuf, i = j + k, i + k
            if self._nbuf == self.chunk_samples:
                self._flush()

    def _flush(self) -> None:
        k, s = self._nbuf, self.count
        if k == 0:
            return
        block = self._buf[:k]
        small = {"ids": self._buf_ids[:k].astype("<i8"), "labels": self._buf_labels[:k].astype("<i8"),
                 "checksums": _crcs(block).astype("<u4")}
        with self._io("write samples"):
            self._reserve(s + k)
            self._samples.resize(s + k, axis=0)
            self._samples[s:s + k] = block
        for name, a in small.items():
            self._crc[name] = zlib.crc32(a, self._crc[name])
            self._pending[name].append(a)
        self.count, self._nbuf = s + k, 0
        if self.count - self._small_count >= _SMALL_CHUNK:
            self._flush_small()

    def _flush_small(self) -> None:
        # Written a whole chunk at a time: a partial chunk write per sample chunk halved the write speed.
        s, e = self._small_count, self.count
        if e > s:
            with self._io("write sample ids"):
                for name, parts in self._pending.items():
                    self._file[name].resize(e, axis=0)
                    self._file[name][s:e] = np.concatenate(parts)
                    parts.clear()
            self._small_count = e

    def _reserve(self, count: int) -> None:
        """Allocate disk space ahead of HDF5, so that a full disk fails here, cleanly.

        HDF5 defers chunk writes to its cache and handles ENOSPC badly: the errors surface in destructors
        and h5py 3.16 / HDF5 2.0 then segfaults in flush(). So HDF5 must never be the one to hit it.
        """
        need = -(-count // self.chunk_samples) * self.chunk_samples * self.sample_bytes + 24 * count + _META_MARGIN
        if need <= self._reserved:
            return
        for target in (need + max(1 << 20, need // 8), need):  # ahead (few calls), else just enough
            try:
                os.posix_fallocate(self._fd, 0, target)
                break
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # cannot reserve here: write unprotected
                    break
                if e.errno not in (errno.ENOSPC, errno.EDQUOT) or target == need:
                    raise
        self._reserved = target

    def commit(self) -> dict:
        """Finish and fsync the HDF5 file, rename it into place, then write the manifest; returns the manifest."""
        if self._state != "open":
            raise RuntimeError(f"shard writer for {self.path} is {self._state}")
        with self._io("finish the HDF5 file"):
            self._flush()
            self._flush_small()
            self._file.flush()  # close() can swallow write errors; flush() reports them
            end = self._file.id.get_filesize()  # HDF5's end of allocation: the reservation goes beyond
            self._file.close()
            self._file = None
            if 0 < end < os.fstat(self._fd).st_size:
                os.ftruncate(self._fd, end)
            os.fsync(self._fd)
            fd, self._fd = self._fd, None
            os.close(fd)
            manifest = {"format_version": FORMAT_VERSION, "file": os.path.basename(self.path), "meta": self.meta,
                        "count": self.count, "sample_shape": list(self.sample_shape), "dtype": self.dtype.str,
                        "file_size": os.path.getsize(self.tmp_path), "chunk_samples": self.chunk_samples,
                        "compression": self.compression, "checksum": "crc32",
                        **{f"{k}_crc32": v for k, v in self._crc.items()}, "created": time.time()}
            # An older shard's manifest must not vouch for the new file, even for an instant.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(manifest_path(self.path))
            os.replace(self.tmp_path, self.path)
            self._state = "renamed"
        directory, tmp = os.path.dirname(os.path.abspath(self.path)), _temp_name(manifest_path(self.path))
        try:
            _fsync_dir(directory)  # the data's rename must be durable before the manifest's
            try:
                with open(tmp, "x") as f:
                    json.dump(manifest, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, manifest_path(self.path))
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            _fsync_dir(directory)
        except OSError as e:
            # Without its manifest the .h5 is only an "incomplete" shard: remove it rather than leave junk.
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self._state = "aborted"
            raise _write_error(e, "write the manifest", self.path) from e
        self._state = "committed"
        return manifest

    def abort(self) -> None:
        """Drop everything written so far (removes the temp file); safe to call more than once."""
        if self._state in ("committed", "aborted"):
            return
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.close()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._file = self._fd = None
        if self._state == "open":
            with contextlib.suppress(OSError):
                os.unlink(self.tmp_path)
        self._state = "aborted"

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.commit()
        return False

    def __del__(self):  # an uncommitted writer that is gone never will be: remove its temp file
        with contextlib.suppress(Exception):
            self.abort()
