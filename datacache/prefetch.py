"""A cache's batches read ahead in a thread, and handed over as torch tensors."""

from __future__ import annotations

import functools
import queue
import threading
import time

__all__ = ["Prefetcher", "as_tensors"]


class Prefetcher:
    """Runs a batch generator in a thread, `depth` batches ahead; counts the time the consumer waits."""

    def __init__(self, produce, depth: int, stats):  # stats: the cache's CacheStats (wait_s, fetch_s)
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stats = stats
        self._stop = threading.Event()
        self._ended: BaseException | None = None  # StopIteration or the producer's error, once taken: raised again
        # The thread holds the queue and the event, not this object: an epoch dropped unfinished is collected,
        # and __del__ ends its thread (which closes the generator, aborting a half-written shard).
        self._thread = threading.Thread(target=_run, args=(produce, self._q, self._stop), name="datacache-prefetch",
                                        daemon=True)
        self._thread.start()
        self.closer = functools.partial(_close, self._stop, self._thread)  # close() without keeping this alive

    def __iter__(self):
        return self

    def __next__(self):
        if self._ended is not None:  # the queue stays empty from now on: get() would block forever
            raise self._ended
        if self._stop.is_set():
            self._abandoned()
        t0 = time.perf_counter()
        try:
            item = self._q.get_nowait()  # ready: no data wait (taking the GIL back is CPU sharing, not data)
        except queue.Empty:
            t1 = time.perf_counter()
            item = self._get()
            self._stats.wait_s += time.perf_counter() - t1
        self._stats.fetch_s += time.perf_counter() - t0
        if item is _END:
            self._ended = StopIteration()
            raise self._ended
        if isinstance(item, BaseException):
            self._ended = item
            raise item
        return item

    def _get(self):
        while True:
            if self._stop.is_set():  # closed: nothing more will be queued
                self._abandoned()
            try:
                return self._q.get(timeout=0.1)
            except queue.Empty:
                continue

    def _abandoned(self):
        self._ended = RuntimeError("this epoch's batches were closed before its end (close(), or the cache "
                                   "started another epoch, which abandons an unfinished one)")
        raise self._ended

    def close(self) -> None:
        """Stop reading ahead (call it when leaving an epoch early)."""
        _close(self._stop, self._thread)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self._stop.set()  # not joined: a finalizer may run on any thread


_END = object()


def _run(produce, q: queue.Queue, stop: threading.Event) -> None:
    try:
        for item in produce:
            if not _put(q, stop, item):
                produce.close()  # an abandoned first epoch leaves no half-written shard
                return
        _put(q, stop, _END)
    except BaseException as exc:  # handed to the consumer, raised where it iterates
        _put(q, stop, exc)


def _put(q: queue.Queue, stop: threading.Event, item) -> bool:
    """Queue `item` unless the consumer has gone (then False): never block a close() forever."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _close(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    if thread is not threading.current_thread():
        thread.join()


def as_tensors(batches):
    """(inputs, labels) numpy batches as torch tensors sharing their memory. Only here: warming a shard (`mpitrain
    cache warm`) decodes and writes numpy arrays, and skips torch's import (~1.3 s a process)."""
    import torch  # on the caller's thread: the generator's body runs on the read-ahead thread

    return ((torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches)
