"""One rank's part of a dataset: preprocessed once from the source, then served from a local HDF5 shard and memory."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .partition import epoch_batches, partition, steps_per_epoch
from . import repair
from .pipeline import FORMAT_VERSION as PIPELINE_FORMAT, check_shape
from .prefetch import Prefetcher, as_tensors
from .shard import ShardError, ShardReader, ShardWriter, check_writable, shard_lock
from .sources import Source, UnreadableSample


@dataclass
class CacheStats:
    """What an epoch cost: where samples came from, and how long the consumer waited for them."""

    from_source: int = 0
    from_shard: int = 0
    from_memory: int = 0
    skipped: list = field(default_factory=list)  # names of unreadable samples
    wait_s: float = 0.0  # blocked on an empty read-ahead queue: the data was not ready
    fetch_s: float = 0.0  # all time spent taking batches, including the GIL handoff from the read-ahead thread
    events: list = field(default_factory=list)  # warnings, rebuilds, fallbacks (also printed)


class SampleCache:
    """The levels source → node-local HDF5 shard → memory, for the samples rank `rank` of `ranks` owns.

    The dataset is split once into `ranks` fixed random parts (see
    partition.py); this rank caches and serves only its part, so no sample
    crosses the network and every sample is served exactly once per epoch
    across all ranks. Each epoch re-shuffles the part. The first epoch reads
    the source, preprocesses, writes the shard (temp file + rename, under a
    lock: two jobs sharing the directory never write the same shard) and
    keeps what fits in `memory_bytes`; later epochs read memory first, then
    the shard. A shard that is truncated, corrupt, foreign or unfinished is
    never served: it is removed and rebuilt from the source. A shard changed
    on disk while its samples came from memory (which no read would notice)
    is found at the end of the epoch and rewritten from the verified copies
    in memory (repair.py), or else removed and rebuilt. If the cache
    directory cannot be written (read-only, full) the source is read every
    epoch, with a warning.

    on_error: "skip" drops unreadable source samples (counted, warned); "fail"
    decodes the whole part when the cache is built, so a bad sample stops the
    job before training starts, never mid-epoch.
    """

    def __init__(self, source: Source, pipeline, cache_dir: str | None, rank: int = 0, ranks: int = 1, *,
                 memory_bytes: int = 256 << 20, on_error: str = "skip", seed: int = 0, log=print):
        if on_error not in ("skip", "fail"):
            raise ValueError(f"on_error must be 'skip' or 'fail', got {on_error!r}")
        self.source, self.pipeline, self.rank, self.ranks = source, pipeline, rank, ranks
        self.on_error, self.seed, self.memory_bytes, self.log = on_error, seed, memory_bytes, log
        self.ids = partition(len(source), ranks, rank, seed)
        self.meta = dict(pipeline=pipeline.hash, pipeline_format=PIPELINE_FORMAT, source=source.fingerprint(),
                         ranks=ranks, rank=rank, partition_seed=seed, samples=len(self.ids))
        self.stats = CacheStats()
        self.reader: ShardReader | None = None
        self.memory: np.ndarray | None = None  # shard positions [0, len(memory)) held in RAM
        self._labels: np.ndarray | None = None  # every shard position's label, checked at open (8 bytes each)
        self._shard_pos: np.ndarray | None = None  # this rank's position -> shard position (-1: skipped)
        self.path = None
        self.disabled = None
        self._epoch = None  # closes the latest epoch's read-ahead: starting another abandons it if unfinished
        self._shape: tuple | None = None  # every sample's: the shard's, else the first decoded sample's
        self._identity = None  # the shard's files as opened (repair.identity)
        if cache_dir is not None:
            name = f"{pipeline.hash}-{self.meta['source'][:12]}-r{rank}of{ranks}-s{seed}.h5"
            self.path = os.path.join(cache_dir, name)
            self.disabled = check_writable(cache_dir) if os.path.isdir(cache_dir) else _make_dir(cache_dir)
            if self.disabled:
                self._event(f"cache disabled ({self.disabled}): reading {source.describe()} every epoch")
            else:
                self._open()
        else:
            self.disabled = "no cache directory given"
        if on_error == "fail" and self.reader is None and not self.disabled:
            self.warm()

    # -- state -------------------------------------------------------------------
    @property
    def state(self) -> str:
        """"warm" (served from shard and memory), "cold" (next epoch builds the shard) or "disabled"."""
        return "warm" if self.reader is not None else ("disabled" if self.disabled else "cold")

    @property
    def _sample_shape(self) -> tuple:
        return (0,) if self._shape is None else self._shape

    def _event(self, text: str) -> None:
        self.stats.events.append(text)
        self.log(f"[datacache rank {self.rank}] {text}")

    def _open(self, locked: bool = False) -> None:
        """Use the shard if it is complete and ours; remove it (to rebuild) if it is anything else.
        locked: this cache holds the shard's lock (about to write it), so removes without taking it."""
        try:
            self._identity = repair.identity(self.path)  # before reading: a change while reading is seen later
            reader = ShardReader(self.path, self.meta)
        except ShardError as exc:
            if exc.reason != "missing":
                self._event(f"shard not used ({exc.reason}: {exc}); rebuilding from the source")
                self._remove(locked)
            return
        try:
            where = {int(i): p for p, i in enumerate(reader.ids)}
            self._shard_pos = np.array([where.get(int(i), -1) for i in self.ids], dtype=np.int64)
            # Read here, inside the fall-back: a label that fails its checksum rebuilds the shard before it is served.
            self.reader, self._labels, self._shape = reader, reader.labels, reader.sample_shape
            fit = min(len(reader), self.memory_bytes // max(1, reader.sample_bytes))
            self.memory = reader.read(np.arange(fit)) if fit else None  # checksums verified on the way in
        except ShardError as exc:
            self.reader = reader
            self._invalidate(f"{exc.reason}: {exc}", locked)

    def _invalidate(self, why: str, locked: bool = False) -> None:
        self._event(f"shard invalid ({why}); serving from the source and rebuilding")
        if self.reader is not None:
            self.reader.close()
        self.reader, self.memory, self._labels, self._shard_pos = None, None, None, None
        self._remove(locked)

    def _remove(self, locked: bool = False) -> None:
        """Delete our shard, but only under its lock: "incomplete" may be another job between its renames."""
        if locked:
            _remove(self.path)
            return
        try:
            with shard_lock(self.path, blocking=False):
                _remove(self.path)
        except TimeoutError:
            self._event("another job holds the shard's lock: leaving it to that job")
        except OSError as exc:  # no lock file possible, or flock unsupported (some NFS/Lustre mounts)
            self.disabled = f"cannot lock {self.path}: {exc}"
            self._event(f"cache disabled ({self.disabled}): reading the source every epoch")

    # -- serving -------------------------------------------------------------------
    def steps(self, batch_size: int) -> int:
        return steps_per_epoch(len(self.source), self.ranks, batch_size)

    def batches(self, epoch: int, batch_size: int, prefetch: int = 4, shuffle_seed: int | None = None):
        """Exactly `steps(batch_size)` (inputs, labels) tensor batches of this rank's part, read ahead in a thread.

        shuffle_seed (default: the partition seed) orders the epochs: a sweep over
        training seeds keeps one partition, hence one set of shards.
        """
        seed = self.seed if shuffle_seed is None else shuffle_seed
        plan = epoch_batches(len(self.ids), self.steps(batch_size), epoch, seed, self.rank)
        self._end_epoch()
        if self.reader is None and not self.disabled:
            self._open()  # another job sharing the directory may have built the shard since: use it
        produce = self._warm_batches(plan) if self.reader is not None else self._cold_batches(plan)
        batches = Prefetcher(as_tensors(produce), max(1, prefetch), self.stats)
        self._epoch = batches.closer
        return batches

    def _end_epoch(self) -> None:
        """Abandon the previous epoch if unfinished: its thread ends and a shard it was writing is dropped (no
        partial shard is committed), and its lock is released before this epoch claims it."""
        closer, self._epoch = self._epoch, None
        if closer is not None:
            closer()

    def _warm_batches(self, plan):
        for positions in plan:
            if self.reader is None:  # invalidated earlier this epoch: the rest comes from the source
                yield self._decode(positions)
                continue
            sp = self._shard_pos[positions]
            sp = sp[sp >= 0]  # samples skipped when the shard was built stay skipped
            try:
                x = self._read(sp)
            except ShardError as exc:
                self._invalidate(str(exc))
                yield self._decode(positions)
                continue
            yield x, self._labels[sp]
        self.check_disk()  # still in the read-ahead thread: the consumer trains on the last batches meanwhile

    def check_disk(self) -> None:
        """If the shard's files changed since opened, verify them; if damaged, rewrite the shard from memory and
        verified reads, else remove it (the next epoch rebuilds it). Reads verify what they read, but samples
        held in memory are never read again: without this, damage to them would outlive the run."""
        if self.reader is None or repair.identity(self.path) == self._identity:
            return
        why = repair.damage(self.path, self.meta)
        if why is None:  # touched, or rebuilt soundly by another job sharing the directory
            self._identity = repair.identity(self.path)
            return
        self._event(f"shard damaged on disk during the run ({why}); rewriting it from memory and verified reads")
        try:
            repair.rewrite(self.path, self.meta, self.reader, self._labels, self.memory)
        except TimeoutError:
            self._event("another job holds the shard's lock: leaving the shard to that job")
            return
        except (ShardError, OSError) as exc:
            self._invalidate(f"cannot rewrite it: {exc}")
            return
        self.reader.close()
        self.reader = None
        self._open()  # the new file, verified as any shard at open

    def _read(self, sp: np.ndarray) -> np.ndarray:
        """Samples at shard positions `sp`, from memory where held; counted only once read (a failed read is
        served, and counted, from the source)."""
        m = 0 if self.memory is None else len(self.memory)
        hit = sp < m
        hits = int(hit.sum())
        if hits == len(sp):
            out = self.memory[sp]
        elif hits == 0:
            out = self.reader.read(sp)
        else:
            out = np.empty((len(sp), *self.reader.sample_shape), dtype=self.reader.dtype)
            out[hit] = self.memory[sp[hit]]
            out[~hit] = self.reader.read(sp[~hit])
        self.stats.from_memory += hits
        self.stats.from_shard += len(sp) - hits
        return out

    def _decode(self, positions, sink=None):
        """Preprocess these positions from the source; each decoded sample also goes to `sink`."""
        xs, ys = [], []
        for p in positions:
            i = int(self.ids[p])
            try:
                x = self.pipeline.apply(self.source.raw(i), self.source.name(i))
                check_shape(x, self._shape, self.source.name(i))
            except UnreadableSample as exc:
                if self.on_error == "fail":
                    raise
                self.stats.skipped.append(self.source.name(i))
                self._event(f"skipping unreadable sample: {exc}")
                continue
            y = self.source.label(i)
            if self._shape is None:
                self._shape = x.shape
            if sink is not None:
                sink(i, y, x)
            xs.append(x)
            ys.append(y)
        self.stats.from_source += len(xs)
        # A batch whose samples were all skipped is still (0, *sample shape), as a warm one would be.
        x = np.stack(xs) if xs else np.empty((0, *self._sample_shape), dtype=np.float32)
        return x, np.asarray(ys, dtype=np.int64)

    def _cold_batches(self, plan, serve: bool = True):
        """First epoch: serve from the source while writing the shard; commit only if every sample was seen.
        The writer and the lock belong to this epoch alone: an epoch left unfinished drops only its own file.
        serve=False (warm()): a shard found complete once the lock is ours is not read through."""
        build = self._claim()
        if build is not None:
            self._open(locked=True)  # the lock's previous holder may have committed the shard: never rebuild it
            if self.reader is not None:
                build.abort()  # releases the lock: nothing to write
                if serve:
                    yield from self._warm_batches(plan)
                return
        done = False
        try:
            for positions in plan:
                yield self._decode(positions, build.append if build is not None else None)
            done = True
        except GeneratorExit:
            if build is not None and build.writer is not None:
                self._event("an epoch was left before its end: the shard it was writing is dropped")
            raise
        finally:
            if build is not None and not done:  # abandoned or failed epoch: no partial shard
                build.abort()
        if build is not None:
            self._finish(build)

    def _claim(self) -> "_Build | None":
        """This epoch's shard build if this rank may write it: the directory works and no other job holds the lock."""
        if self.disabled:
            return None
        lock = shard_lock(self.path, blocking=False)
        try:
            lock.__enter__()
        except TimeoutError:
            self._event("another job is writing this shard: serving from the source this epoch")
            return None
        except OSError as exc:
            self.disabled = f"cannot lock {self.path}: {exc}"
            self._event(f"cache disabled ({self.disabled}): reading the source every epoch")
            return None
        return _Build(self, lock)

    def _finish(self, build: "_Build") -> None:
        if build.writer is None:  # nothing was decoded (every sample unreadable), or the writing stopped
            build.abort()
            return
        try:
            build.writer.commit()
        except OSError as exc:
            self._event(f"cannot write the cache ({exc}): serving from the source")
            self.disabled = str(exc)
        finally:
            build.abort()  # after a commit: only releases the lock
        if not self.disabled:
            self._open()

    def warm(self) -> None:
        """Build the shard now (no training): one pass over the source in position order."""
        self._end_epoch()
        if self.reader is not None or self.disabled:
            return
        for _ in self._cold_batches([np.arange(len(self.ids))], serve=False):
            pass

    def close(self) -> None:
        """The end of the run: a shard damaged in its last epoch is repaired now (see check_disk)."""
        self._end_epoch()
        self.check_disk()
        if self.reader is not None:
            self.reader.close()


class _Build:
    """One epoch's writing of the shard: the lock held, and the writer, opened on the first sample that decodes
    (its shape and dtype are the shard's). A full or failing disk stops the writing, never the epoch."""

    def __init__(self, cache: SampleCache, lock):
        self.cache, self.lock, self.writer = cache, lock, None

    def append(self, i: int, y: int, x: np.ndarray) -> None:
        if self.lock is None:  # stopped
            return
        try:
            if self.writer is None:
                self.writer = ShardWriter(self.cache.path, x.shape, x.dtype, self.cache.meta).__enter__()
            self.writer.append(i, y, x)
        except OSError as exc:
            self.abort()
            self.cache.disabled = str(exc)
            self.cache._event(f"cannot write the cache ({exc}): serving from the source")

    def abort(self) -> None:
        """Drop the file unless committed (ShardWriter.abort), and release the lock; safe to call again."""
        writer, self.writer = self.writer, None  # stopped writing: nothing left to commit
        if writer is not None:
            writer.abort()
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.__exit__(None, None, None)


def _remove(path: str) -> None:
    for p in (path, path + ".json"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def _make_dir(path: str) -> str | None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror}"
    return check_writable(path)
