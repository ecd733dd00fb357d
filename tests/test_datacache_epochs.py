"""SampleCache epochs: their ends, epochs left unfinished, two caches sharing a directory, odd-sized images."""

from __future__ import annotations

import os
import threading

import pytest

from datacache import Pipeline, SampleCache
from datacache.cache import CacheStats
from datacache.prefetch import Prefetcher
from datacache.shard import ShardReader
from datacache.sources import LabelsCsvSource
from datacache_helpers import fresh_digests, make_png_dataset, served_digests

PIPE = Pipeline(mode="L", mean=(0.5,), std=(0.25,))


@pytest.fixture
def source(tmp_path):
    return LabelsCsvSource(make_png_dataset(tmp_path / "src", n=64))


def cache(source, tmp_path, **kw):
    kw.setdefault("log", lambda *a: None)
    return SampleCache(source, kw.pop("pipeline", PIPE), str(tmp_path / "cache"), **kw)


# ----------------------------------------------------------------------------- the end of an epoch

@pytest.mark.timeout(20)
@pytest.mark.parametrize("warm", [False, True])
def test_next_after_the_last_batch_keeps_raising_stop_iteration(source, tmp_path, warm):
    c = cache(source, tmp_path)
    if warm:
        c.warm()
    it = c.batches(0, 16)
    assert len(list(it)) == c.steps(16)
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(it)


def _fails_after_one():
    yield 1
    raise ValueError("sample 7 is bad")


@pytest.mark.timeout(20)
def test_next_after_the_producers_error_raises_that_error_again():
    it = Prefetcher(_fails_after_one(), 2, CacheStats())
    assert next(it) == 1
    for _ in range(3):
        with pytest.raises(ValueError, match="sample 7 is bad"):
            next(it)


# ----------------------------------------------------------------------------- epochs left unfinished

def prefetch_threads() -> int:
    return sum(t.name == "datacache-prefetch" and t.is_alive() for t in threading.enumerate())


@pytest.mark.timeout(60)
def test_an_epoch_left_without_close_leaves_no_partial_shard_and_no_thread(source, tmp_path):
    """`for ...: break` drops the first epoch half-written: the next epoch builds the shard from scratch."""
    c = cache(source, tmp_path)
    want = fresh_digests(source, PIPE)
    for x, y in c.batches(0, 2):
        break
    for e in (1, 2):  # built anew, then served from it
        assert sorted(served_digests(list(c.batches(e, 2)))) == want, f"epoch {e}"
    shard = ShardReader(c.path, c.meta)
    assert len(shard) == len(source) and sorted(shard.ids.tolist()) == list(range(len(source)))
    assert shard.verify() == [] and c.stats.from_memory == len(source)
    c.close()  # joins the last epoch's thread: none may be left reading ahead
    assert prefetch_threads() == 0


@pytest.mark.timeout(60)
def test_a_second_epoch_abandons_the_first_one_still_open(source, tmp_path):
    c = cache(source, tmp_path)
    first = c.batches(0, 2)
    next(first)
    second = c.batches(1, 2)  # the first is abandoned: its shard is not written, its thread ends
    assert prefetch_threads() == 1
    assert sorted(served_digests(list(second))) == fresh_digests(source, PIPE) and c.state == "warm"
    with pytest.raises(RuntimeError, match="started another epoch"):
        next(first)  # never a silent short epoch, never a hang
    assert len(ShardReader(c.path, c.meta)) == len(source)
    assert any("left before its end" in e for e in c.stats.events), c.stats.events


# ----------------------------------------------------------------------------- two jobs sharing the directory

@pytest.mark.timeout(60)
def test_a_cache_uses_the_shard_another_job_built_meanwhile(source, tmp_path):
    """Both start cold on one directory; once A's shard is complete, B serves from it and never rebuilds it."""
    a, b = cache(source, tmp_path), cache(source, tmp_path)
    assert a.state == b.state == "cold"
    want = fresh_digests(source, PIPE)
    assert sorted(served_digests(list(a.batches(0, 8)))) == want and a.state == "warm"
    inode = os.stat(a.path).st_ino
    assert sorted(served_digests(list(b.batches(0, 8)))) == want
    assert (b.stats.from_source, b.stats.from_memory, b.state) == (0, len(source), "warm")
    assert os.stat(a.path).st_ino == inode  # the same file: not decoded and written again


@pytest.mark.timeout(60)
def test_warming_after_another_job_committed_the_shard_does_not_rebuild_it(source, tmp_path):
    """B takes the lock after A released it: the manifest is read again under the lock, and A's shard is used."""
    a, b = cache(source, tmp_path), cache(source, tmp_path)
    a.warm()
    inode = os.stat(a.path).st_ino
    b.warm()
    assert (b.state, b.stats.from_source, os.stat(a.path).st_ino) == ("warm", 0, inode)
    assert sorted(served_digests(list(b.batches(0, 8)))) == fresh_digests(source, PIPE)
    assert b.stats.from_source == 0
