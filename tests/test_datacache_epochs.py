"""SampleCache epochs: their ends, epochs left unfinished, two caches sharing a directory, odd-sized images."""

from __future__ import annotations

import os
import re
import threading

import pytest

from datacache import Pipeline, SampleCache
from datacache.cache import CacheStats
from datacache.prefetch import Prefetcher
from datacache.shard import ShardReader
from datacache.sources import LabelsCsvSource, UnreadableSample
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


# ----------------------------------------------------------------------------- an image of another size

def with_an_odd_image(tmp_path) -> tuple[LabelsCsvSource, str]:
    """30 images of 8x8 and one of 10x10 (listed 13th): without resize or crop it preprocesses to another shape."""
    from PIL import Image

    root = make_png_dataset(tmp_path / "src", n=30)
    Image.new("L", (10, 10), 128).save(os.path.join(root, "odd.png"))
    rows = open(os.path.join(root, "labels.csv")).read().splitlines()
    rows.insert(13, "odd.png,3")
    open(os.path.join(root, "labels.csv"), "w").write("\n".join(rows) + "\n")
    src = LabelsCsvSource(root)
    return src, os.path.join(root, "odd.png")


def test_an_image_of_another_size_is_skipped_by_name(tmp_path):
    src, odd = with_an_odd_image(tmp_path)
    events = []
    c = cache(src, tmp_path, log=events.append)
    assert len(served_digests(list(c.batches(0, 7)))) == 30 and c.stats.skipped == [odd]
    assert any(odd in e and "(1, 10, 10)" in e and "(1, 8, 8)" in e and "--crop" in e for e in events), events
    assert c.state == "warm" and len(ShardReader(c.path, c.meta)) == 30
    assert len(served_digests(list(c.batches(1, 7)))) == 30  # still skipped, from the shard


def test_an_image_of_another_size_stops_a_fail_policy_job_naming_it(tmp_path):
    src, odd = with_an_odd_image(tmp_path)
    with pytest.raises(UnreadableSample, match=rf"^{re.escape(odd)}: preprocessed to shape \(1, 10, 10\), but the "
                                               rf"other samples are \(1, 8, 8\).*--crop") as err:
        cache(src, tmp_path, on_error="fail")
    assert err.value.where == odd and not [p for p in os.listdir(tmp_path / "cache") if p.endswith(".h5")]


def test_the_dataloader_path_skips_an_image_of_another_size_too(tmp_path):
    """Samples the shard lacks are decoded again in DataLoader batches: the odd one is dropped there as well."""
    from datacache import CachedDataset

    src, odd = with_an_odd_image(tmp_path)
    c = cache(src, tmp_path)
    c.warm()
    assert c.stats.skipped == [odd]
    assert sum(len(y) for _, y in CachedDataset(c).loader(7, epoch=1)) == 30
