"""One HDF5 shard of preprocessed samples: atomic writing, a JSON manifest, per-sample checksums, locking."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
import zlib

import h5py
import numpy as np

FORMAT_VERSION = 1
REASONS = ("missing", "truncated", "corrupt", "foreign", "incomplete")
# Measured on 60k float32 (1, 28, 28): 64-256 samples per chunk write equally fast, and reads bypass
# HDF5's chunk machinery (see ShardReader), so the size only has to stay under HDF5's 1 MiB chunk cache.
_CHUNK_SAMPLES, _MAX_CHUNK_BYTES = 128, 1 << 20
_SMALL_CHUNK = 8192     # ids, labels, checksums
_SMALL = {"ids": "<i8", "labels": "<i8", "checksums": "<u4"}  # fixed byte order: their crc32 is portable
_IOV_MAX = 1024         # Linux limit on buffers per preadv call
_META_MARGIN = 1 << 20  # disk reserved beyond the sample bytes for HDF5's own index and heaps
_MANIFEST_TYPES = {"count": int, "sample_shape": list, "dtype": str, "file_size": int, "meta": dict,
                   "checksums_crc32": int, "ids_crc32": int, "labels_crc32": int, "created": (int, float)}


class ShardError(Exception):
    """A shard that cannot be used; `reason` is one of REASONS, `positions` the bad samples if known."""

    def __init__(self, reason: str, message: str, positions=()):
        if reason not in REASONS:
            # TypeError, not ValueError: torch's DataLoader re-raises a worker's error as exc_type(msg)
            # and turns only a TypeError into a plain RuntimeError.
            raise TypeError(f"ShardError reason must be one of {REASONS}, got {reason!r}")
        super().__init__(message)
        self.reason, self.positions = reason, list(positions)

    def __reduce__(self):
        return type(self), (self.reason, str(self), self.positions)


class ShardLockBusy(TimeoutError, BlockingIOError):
    """The shard lock is held elsewhere and the caller would not wait (longer)."""


def manifest_path(path) -> str:
    return os.fspath(path) + ".json"


def _crcs(arr: np.ndarray) -> np.ndarray:
    return np.fromiter((zlib.crc32(row) for row in arr), dtype=np.uint32, count=len(arr))


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF):  # some filesystems refuse to fsync a directory
            raise
    finally:
        os.close(fd)


def _temp_name(path: str) -> str:
    # The pid tells whose a stale temp file is; the random part keeps two writers in one process apart.
    d, name = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{name}.tmp.{os.getpid()}.{os.urandom(3).hex()}")


def _write_error(e: Exception, what: str, path: str) -> OSError:
    """An OSError of the errno's subclass, naming the directory; h5py often drops errno, so guess it."""
    directory = os.path.dirname(os.path.abspath(path))
    code = getattr(e, "errno", None)
    if code is None:
        try:
            st = os.statvfs(directory)
            code = errno.EROFS if st.f_flag & os.ST_RDONLY else errno.ENOSPC if st.f_bavail == 0 else errno.EIO
        except OSError:
            code = errno.EIO
    return OSError(code, f"cannot {what} for shard {os.path.basename(path)} in directory {directory}: "
                         f"{os.strerror(code)} ({e})")


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


def _load_manifest(path: str, expect_meta: dict | None) -> dict:
    mpath = manifest_path(path)
    try:
        with open(mpath, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        if os.path.exists(path):
            raise ShardError("incomplete", f"shard {path} has no manifest {mpath}: "
                                           f"its writer did not finish") from None
        raise ShardError("missing", f"shard {path} does not exist") from None
    try:
        m = json.loads(raw)
    except ValueError as e:
        raise ShardError("corrupt", f"shard manifest {mpath} is not valid JSON ({e})") from None
    if not isinstance(m, dict):
        raise ShardError("corrupt", f"shard manifest {mpath} is not a JSON object")
    if m.get("format_version") != FORMAT_VERSION:
        raise ShardError("foreign", f"shard {path} has format_version {m.get('format_version')!r}, "
                                    f"this code reads {FORMAT_VERSION}")
    bad = [k for k, t in _MANIFEST_TYPES.items() if not isinstance(m.get(k), t) or isinstance(m.get(k), bool)]
    if bad:
        raise ShardError("corrupt", f"shard manifest {mpath}: missing or malformed {bad}")
    expect = json.loads(json.dumps(expect_meta or {}))  # as JSON sees it: an expected tuple matches a stored list
    have = {k: m["meta"].get(k, "<absent>") for k in expect}
    differ = [f"{k}: shard has {have[k]!r}, expected {v!r}" for k, v in expect.items() if have[k] != v]
    if differ:
        raise ShardError("foreign", f"shard {path} was built for different inputs: " + "; ".join(differ))
    return m


class ShardReader:
    """A committed shard. Construction checks only the manifest and the file size; data is read lazily.

    Uncompressed samples are read with preadv at the chunk addresses HDF5 reports: measured 20-50x
    faster than h5py selections for random batches. Compressed shards go through h5py. Open files
    belong to one process and are never pickled: a reader sent to a DataLoader worker reopens there.
    """

    def __init__(self, path, expect_meta: dict | None = None, *, verify: bool = True):
        self.path, self.verify_reads = os.fspath(path), verify
        self.manifest = m = _load_manifest(self.path, expect_meta)
        self.meta, self._count = m["meta"], m["count"]
        try:
            self.sample_shape, self.dtype = tuple(int(d) for d in m["sample_shape"]), np.dtype(m["dtype"])
        except (TypeError, ValueError) as e:
            raise ShardError("corrupt", f"shard manifest {manifest_path(path)}: bad shape or dtype ({e})") from None
        self.sample_bytes = int(np.prod(self.sample_shape)) * self.dtype.itemsize
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            raise ShardError("missing", f"shard {self.path} is gone but its manifest remains") from None
        if size != m["file_size"]:
            raise ShardError("truncated", f"shard {self.path} is {size} bytes, its manifest says "
                                          f"{m['file_size']} (truncated or overwritten)")
        self._arrays, self._opening = {}, threading.Lock()
        self._drop_handles()

    def _drop_handles(self) -> None:
        self._h5 = self._ds = self._fd = self._pid = self._offsets = None

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._count * self.sample_bytes

    @property
    def ids(self) -> np.ndarray:
        return self._small("ids")

    @property
    def labels(self) -> np.ndarray:
        return self._small("labels")

    def _small(self, name: str) -> np.ndarray:
        """ids, labels or checksums: read once, checked against the manifest's crc32 of them."""
        if name not in self._arrays:
            self._open()
            try:
                a = self._h5[name][:]
            except (KeyError, OSError) as e:
                raise self._unreadable(e) from None
            if a.shape != (self._count,) or zlib.crc32(a.astype(_SMALL[name])) != self.manifest[f"{name}_crc32"]:
                raise ShardError("corrupt", f"shard {self.path}: dataset {name!r} does not match the manifest")
            self._arrays[name] = a
        return self._arrays[name]

    def _unreadable(self, e: Exception) -> ShardError:
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_size == self.manifest["file_size"]:
                return ShardError("corrupt", f"shard {self.path} cannot be read by HDF5: {e}")
        return ShardError("truncated", f"shard {self.path} cannot be read by HDF5 and has changed size: {e}")

    def _open(self) -> None:
        """Open the file read-only in this process (h5py, plus a raw fd when preadv can be used)."""
        if self._pid == os.getpid():
            return
        with self._opening:  # two threads' first reads must not both open (and one leak) the file
            if self._pid != os.getpid():
                self._open_now()

    def _open_now(self) -> None:
        self.close()  # a forked child closes its copies of the parent's handles
        try:
            # Shards are immutable once committed: HDF5's file lock (which fails on some network
            # filesystems) buys nothing.
            h5 = h5py.File(self.path, "r", locking=False)
            ds = h5["samples"]
        except PermissionError:
            raise  # not the shard's fault
        except (KeyError, OSError) as e:
            raise self._unreadable(e) from None
        self._h5, self._ds, self._chunk = h5, ds, (ds.chunks or (max(1, self._count),))[0]
        if ds.shape != (self._count, *self.sample_shape) or ds.dtype != self.dtype:
            self.close()
            raise ShardError("corrupt", f"shard {self.path}: samples are {ds.dtype} {ds.shape}, the manifest "
                                        f"says {self.dtype} {(self._count, *self.sample_shape)}")
        if ds.chunks and ds.id.get_create_plist().get_nfilters() == 0:
            self._offsets = np.full(-(-self._count // self._chunk), -1, np.int64)
            want = self._chunk * self.sample_bytes

            def visit(info):
                if info.size == want:
                    self._offsets[info.chunk_offset[0] // self._chunk] = info.byte_offset
            ds.id.chunk_iter(visit)
            lost = np.flatnonzero((self._offsets < 0) | (self._offsets + want > self.manifest["file_size"]))
            if len(lost):
                self.close()
                raise ShardError("corrupt", f"shard {self.path}: the index of sample chunk(s) "
                                            f"{lost[:10].tolist()} is wrong")
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self._pid = os.getpid()

    def read(self, positions, verify: bool | None = None) -> np.ndarray:
        """Samples at `positions` (any order, repeats allowed): shape (len(positions), *sample_shape)."""
        pos = np.asarray(positions).ravel()
        if pos.size and pos.dtype.kind not in "iu":
            raise TypeError(f"shard positions must be integers, got {pos.dtype}")
        pos = pos.astype(np.int64, copy=False)
        if pos.size and (pos.min() < 0 or pos.max() >= self._count):
            bad = pos[(pos < 0) | (pos >= self._count)]
            raise IndexError(f"positions {bad[:10].tolist()} out of range for shard {self.path} of {self._count}")
        out = np.empty((len(pos), *self.sample_shape), self.dtype)
        if len(pos):
            self._open()
            order = np.argsort(pos, kind="stable")  # ascending offsets: runs coalesce, disks seek forward
            (self._pread if self._fd is not None else self._h5_read)(pos[order], order, out)
            if self.verify_reads if verify is None else verify:
                bad = self._bad(out, pos)
                if bad:
                    more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
                    raise ShardError("corrupt", f"shard {self.path}: checksum mismatch at position(s) "
                                                f"{bad[:10]}{more}", positions=bad)
        return out

    def _pread(self, sp: np.ndarray, order: np.ndarray, out: np.ndarray) -> None:
        c, sb = self._chunk, self.sample_bytes
        flat = memoryview(out.reshape(-1).view(np.uint8))
        # A run of consecutive positions inside one chunk is one read, scattered into its rows of `out`.
        cut = (np.flatnonzero((sp[1:] != sp[:-1] + 1) | (sp[1:] // c != sp[:-1] // c)) + 1).tolist()
        file_at = (self._offsets[sp // c] + (sp % c) * sb).tolist()
        rows = order.tolist()
        for a, b in zip([0, *cut], [*cut, len(sp)]):
            if rows[b - 1] - rows[a] == b - a - 1 and (b - a < 3 or np.all(np.diff(order[a:b]) == 1)):
                bufs = [flat[rows[a] * sb:(rows[a] + b - a) * sb]]  # rows in order too: one buffer
            else:
                bufs = [flat[r * sb:(r + 1) * sb] for r in rows[a:b]]
            for k in range(0, len(bufs), _IOV_MAX):
                part = bufs[k:k + _IOV_MAX]
                got = os.preadv(self._fd, part, file_at[a] + k * sb)
                if got != sum(v.nbytes for v in part):
                    raise ShardError("truncated", f"shard {self.path}: short read at position {int(sp[a]) + k}")

    def _h5_read(self, sp: np.ndarray, order: np.ndarray, out: np.ndarray) -> None:
        # A compressed chunk is decoded whole anyway: read each chunk's span once.
        cut = (np.flatnonzero(sp[1:] // self._chunk != sp[:-1] // self._chunk) + 1).tolist()
        for a, b in zip([0, *cut], [*cut, len(sp)]):
            lo, hi = int(sp[a]), int(sp[b - 1])
            try:
                block = self._ds[lo:hi + 1]
            except OSError as e:
                raise ShardError("corrupt", f"shard {self.path}: positions {lo}..{hi} cannot be decoded ({e})",
                                 positions=range(lo, hi + 1)) from None
            out[order[a:b]] = block[sp[a:b] - lo]

    def _bad(self, arr: np.ndarray, pos: np.ndarray) -> list[int]:
        return sorted(set(pos[_crcs(arr) != self._small("checksums")[pos]].tolist()))

    def read_all(self, verify: bool | None = None) -> np.ndarray:
        """The whole shard in memory, (len(self), *sample_shape)."""
        return self.read(np.arange(self._count), verify)

    def verify(self) -> list[int]:
        """Full scan: the positions whose checksum fails (ids, labels and checksums must match the manifest)."""
        for name in ("ids", "labels"):
            self._small(name)
        step = max(1, (32 << 20) // (self.sample_bytes * self._chunk)) * self._chunk  # whole chunks, ~32 MiB
        bad = []
        for s in range(0, self._count, step):
            pos = np.arange(s, min(self._count, s + step))
            bad += self._bad(self.read(pos, verify=False), pos)
        return bad

    def close(self) -> None:
        """Close the files (a later read reopens them)."""
        if self._fd is not None:
            os.close(self._fd)
        if self._h5 is not None and self._pid == os.getpid():
            with contextlib.suppress(Exception):
                self._h5.close()
        self._drop_handles()

    def __getstate__(self):
        skip = ("_h5", "_ds", "_fd", "_pid", "_offsets", "_opening")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._opening = threading.Lock()
        self._drop_handles()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


@contextlib.contextmanager
def shard_lock(path, blocking: bool = True, timeout: float | None = None):
    """Exclusive flock on `path + ".lock"`: two jobs sharing a cache never write the same shard at once.

    Busy and not waiting (blocking=False, or `timeout` seconds passed): ShardLockBusy, a TimeoutError.
    Re-check the manifest once acquired: the previous holder may have written the shard. flock locks
    belong to an open file, so a second shard_lock on one path in one process conflicts as well.
    The lock file is never removed: a waiter may have it open already, would then lock the unlinked
    inode while a newcomer creates and locks a fresh file, and both would hold "the" lock.
    """
    lock_path = os.fspath(path) + ".lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise _write_error(e, "create the lock file", os.fspath(path)) from e
    try:
        deadline, delay = time.monotonic() + (timeout or 0), 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking and timeout is None else fcntl.LOCK_NB))
                break
            except BlockingIOError:
                left = deadline - time.monotonic()
                if not blocking or left <= 0:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                    wait = f"gave up after {timeout}s" if blocking else "not waiting (blocking=False)"
                    raise ShardLockBusy(errno.EWOULDBLOCK, f"shard lock {lock_path} is held "
                                                           f"(last holder: {holder}); {wait}") from None
                time.sleep(min(delay, left))
                delay = min(2 * delay, 0.5)
            except OSError as e:  # e.g. ENOLCK: NFS without a lock manager, Lustre mounted without flock
                raise OSError(e.errno, f"cannot lock {lock_path}: {e.strerror}") from e
        with contextlib.suppress(OSError):  # only a hint for whoever finds the lock busy
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
        yield lock_path
    finally:
        os.close(fd)  # releases the lock


_ERRNO_REASON = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "permission denied", errno.ENOSPC: "no space left on device",
                 errno.EDQUOT: "disk quota exceeded", errno.ENOENT: "files cannot be created there"}


def check_writable(directory, min_free_bytes: int = 0) -> str | None:
    """None if a file can be created and written in `directory`, else a one-line reason."""
    d = os.fspath(directory)
    if not os.path.isdir(d):
        return f"{d}: " + ("not a directory" if os.path.exists(d) else "does not exist")
    try:
        st = os.statvfs(d)
        if st.f_flag & os.ST_RDONLY:
            return f"{d}: read-only file system"
        if st.f_bavail * st.f_frsize < min_free_bytes:
            return (f"{d}: only {st.f_bavail * st.f_frsize / 2**20:.1f} MiB free, "
                    f"need {min_free_bytes / 2**20:.1f} MiB")
        probe = os.path.join(d, f".check_writable.{os.getpid()}.{os.urandom(3).hex()}")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"x")  # a full disk may still create the inode; writing fails
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        return f"{d}: {_ERRNO_REASON.get(e.errno, e.strerror)} ({e.strerror})"
    return None
