"""What shard writer and reader share: the format version, manifest, checksums, errors, locking."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import zlib

import numpy as np

FORMAT_VERSION = 1
REASONS = ("missing", "truncated", "corrupt", "foreign", "incomplete")
_SMALL = {"ids": "<i8", "labels": "<i8", "checksums": "<u4"}  # fixed byte order: their crc32 is portable
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
