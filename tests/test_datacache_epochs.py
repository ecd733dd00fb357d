"""SampleCache epochs: their ends, epochs left unfinished, two caches sharing a directory, odd-sized images."""

from __future__ import annotations

import pytest

from datacache import Pipeline, SampleCache
from datacache.cache import CacheStats
from datacache.prefetch import Prefetcher
from datacache.sources import LabelsCsvSource
from datacache_helpers import make_png_dataset

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
