"""Scratch buffers the collectives' algorithms borrow and hand back, so that a training loop's steady state allocates none."""

from __future__ import annotations

import threading

from .buffers import Buffer

__all__ = ["SCRATCH", "ScratchPool"]


class ScratchPool:
    """Free scratch buffers by (kind, dtype, element count): `take` reuses one or allocates, `give` keeps it.

    A training loop reduces the same sizes every step, so after its first
    step every take is a reuse (a fresh buffer of megabytes costs its page
    faults on first touch, inside the collective). An algorithm hands its
    scratch back only when it completes: one that was cancelled may still
    have a receive posted into it, so that buffer is dropped, never reused.
    Thread-safe: handles start on the training thread and progress on a
    progress thread. Holds at most `keep` free buffers of one size and
    `max_bytes` in all (a sweep over sizes keeps what fits, drops the rest).
    """

    def __init__(self, keep: int = 8, max_bytes: int = 1 << 30):
        self.keep, self.max_bytes = keep, max_bytes
        self._free: dict[tuple, list[Buffer]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.allocated = 0  # buffers allocated because none of that size was free (for tests and reports)

    def take(self, like: Buffer, count: int) -> Buffer:
        """A buffer of `count` elements of `like`'s kind and dtype, its contents undefined."""
        key = (like._torch, like.dtype, count)
        with self._lock:
            free = self._free.get(key)
            if free:
                buf = free.pop()
                self._bytes -= buf.count * buf.itemsize
                return buf
            self.allocated += 1
        return like.scratch(count)

    def give(self, *bufs: Buffer | None) -> None:
        """Hand back buffers taken here, once nothing (no posted request) reads or writes them any more."""
        with self._lock:
            for buf in bufs:
                if buf is None:
                    continue
                size = buf.count * buf.itemsize
                free = self._free.setdefault((buf._torch, buf.dtype, buf.count), [])
                if len(free) < self.keep and self._bytes + size <= self.max_bytes:
                    free.append(buf)
                    self._bytes += size


SCRATCH = ScratchPool()
