"""datacache under MPI: every rank caches its own part; across ranks each sample is served once per epoch."""

from __future__ import annotations

import pytest

from conftest import assert_everywhere
from datacache import Pipeline, SampleCache
from datacache.sources import LabelsCsvSource
from datacache_helpers import flip_label_byte, fresh_digests, make_png_dataset, served_digests

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

PIPE = Pipeline(mode="L", mean=(0.5,), std=(0.25,))


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    """One directory for all ranks (rank 0's), with a small PNG dataset in it."""
    root = str(tmp_path_factory.mktemp("dc")) if world.Get_rank() == 0 else None
    root = world.bcast(root)
    if world.Get_rank() == 0:
        make_png_dataset(f"{root}/src", n=211)
    world.Barrier()
    return root


def test_each_sample_served_once_per_epoch_across_ranks_cold_and_warm(world, shared_dir):
    source = LabelsCsvSource(f"{shared_dir}/src")
    cache = SampleCache(source, PIPE, f"{shared_dir}/cache", world.Get_rank(), world.Get_size(),
                        log=lambda *a: None)
    want = fresh_digests(source, PIPE)
    for epoch in range(3):
        batches = list(cache.batches(epoch, 16))
        steps = world.allgather(len(batches))
        everyone = sorted(d for part in world.allgather(served_digests(batches)) for d in part)
        ok = len(set(steps)) == 1 and everyone == want and cache.state == "warm"
        assert_everywhere(world, ok, f"epoch {epoch}: steps {steps}, {len(everyone)} of {len(want)} served")
    assert_everywhere(world, cache.stats.from_source == len(cache.ids), "the source was read more than once")
    cache.close()


def test_one_rank_corrupt_shard_and_a_changed_pipeline(world, shared_dir):
    """A corrupted sample in rank 1's shard is never served; a new pipeline builds new shards everywhere."""
    import h5py

    from datacache import CachedDataset

    source = LabelsCsvSource(f"{shared_dir}/src")
    r, P = world.Get_rank(), world.Get_size()
    cache = SampleCache(source, PIPE, f"{shared_dir}/cache2", r, P, memory_bytes=0, log=lambda *a: None)
    cache.warm()
    cache.close()
    if r == min(1, P - 1):
        with h5py.File(cache.path, "r+") as f:
            f["samples"][0] = f["samples"][0] + 3.0
    world.Barrier()
    cache = SampleCache(source, PIPE, f"{shared_dir}/cache2", r, P, memory_bytes=0, log=lambda *a: None)
    everyone = sorted(d for part in world.allgather(served_digests(list(cache.batches(0, 8)))) for d in part)
    assert_everywhere(world, everyone == fresh_digests(source, PIPE), "a corrupt sample was served")

    other = Pipeline(mode="L")
    fresh = SampleCache(source, other, f"{shared_dir}/cache2", r, P, log=lambda *a: None)
    cold = fresh.state == "cold"
    list(fresh.batches(0, 8))
    loader = CachedDataset(fresh).loader(8, epoch=1, workers=1)  # whole batches from each rank's shard
    everyone = sorted(d for part in world.allgather(served_digests(loader)) for d in part)
    assert_everywhere(world, cold and everyone == fresh_digests(source, other), "stale samples after a change")
    cache.close(), fresh.close()


def test_one_rank_corrupt_label_is_served_from_the_source_and_rebuilt(world, shared_dir):
    """A flipped label byte in rank 1's shard: no rank fails or waits, no wrong label is served, it is rebuilt."""
    import torch

    from datacache import CachedDataset, EpochBatchSampler
    from datacache.shard import ShardError

    source = LabelsCsvSource(f"{shared_dir}/src")
    r, P = world.Get_rank(), world.Get_size()
    where = f"{shared_dir}/cache3"
    SampleCache(source, PIPE, where, r, P, log=lambda *a: None).warm()
    victim = min(1, P - 1)
    if r == victim:
        flip_label_byte(SampleCache(source, PIPE, where, r, P, log=lambda *a: None).path, 2)
    world.Barrier()
    want = fresh_digests(source, PIPE)
    cache = SampleCache(source, PIPE, where, r, P, log=lambda *a: None)
    loader = torch.utils.data.DataLoader(CachedDataset(cache), batch_sampler=EpochBatchSampler(cache, 8),
                                         num_workers=1)
    for name, batches in [("workers", lambda: loader)] + [(f"epoch {e}", lambda e=e: cache.batches(e, 8))
                                                            for e in range(3)]:
        try:  # a rank that raised alone would leave the others waiting in the allgather
            served, problem = served_digests(batches()), ""
        except (ShardError, RuntimeError) as exc:
            served, problem = [], f"{type(exc).__name__}: {exc}"
        everyone = sorted(d for part in world.allgather(served) for d in part)
        assert_everywhere(world, not problem and everyone == want, f"{name}: {problem or 'wrong samples served'}")
    s = cache.stats
    counted = s.from_memory + s.from_shard + s.from_source
    rebuilt = r != victim or any("invalid" in e for e in s.events)
    assert_everywhere(world, rebuilt and cache.state == "warm" and counted == 3 * len(cache.ids),
                      f"state {cache.state}, counted {counted} for {3 * len(cache.ids)} served, events {s.events}")
    assert_everywhere(world, cache.reader.verify() == [], "the rebuilt shard does not verify")
    cache.close()
