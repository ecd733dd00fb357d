"""A cache's batches read ahead in a thread, and handed over as torch tensors."""

from __future__ import annotations

import queue
import threading
import time

__all__ = ["Prefetcher", "as_tensors"]


class Prefetcher:
    """Runs a batch generator in a thread, `depth` batches ahead; counts the time the consumer waits."""

    _END = object()

    def __init__(self, produce, depth: int, stats):  # stats: the cache's CacheStats (wait_s, fetch_s)
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stats = stats
        self._stop = threading.Event()
        self._ended: BaseException | None = None  # StopIteration or the producer's error, once taken: raised again
        self._thread = threading.Thread(target=self._run, args=(produce,), name="datacache-prefetch", daemon=True)
        self._thread.start()

    def _run(self, produce) -> None:
        try:
            for item in produce:
                if not self._put(item):
                    produce.close()  # an abandoned first epoch leaves no half-written shard
                    return
            self._put(self._END)
        except BaseException as exc:  # handed to the consumer, raised where it iterates
            self._put(exc)

    def _put(self, item) -> bool:
        """Queue `item` unless the consumer has gone (then False): never block a close() forever."""
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def __next__(self):
        if self._ended is not None:  # the queue stays empty from now on: get() would block forever
            raise self._ended
        t0 = time.perf_counter()
        try:
            item = self._q.get_nowait()  # ready: no data wait (taking the GIL back is CPU sharing, not data)
        except queue.Empty:
            t1 = time.perf_counter()
            item = self._q.get()
            self._stats.wait_s += time.perf_counter() - t1
        self._stats.fetch_s += time.perf_counter() - t0
        if item is self._END:
            self._ended = StopIteration()
            raise self._ended
        if isinstance(item, BaseException):
            self._ended = item
            raise item
        return item

    def close(self) -> None:
        """Stop reading ahead (call it when leaving an epoch early)."""
        self._stop.set()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def as_tensors(batches):
    """(inputs, labels) numpy batches as torch tensors sharing their memory. Only here: warming a shard (`mpitrain
    cache warm`) decodes and writes numpy arrays, and skips torch's import (~1.3 s a process)."""
    import torch  # on the caller's thread: the generator's body runs on the read-ahead thread

    return ((torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches)
