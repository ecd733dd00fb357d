"""datacache under MPI: every rank caches its own part; across ranks each sample is served once per epoch."""

from __future__ import annotations

import pytest

from conftest import assert_everywhere
from datacache import Pipeline, SampleCache
from datacache.sources import LabelsCsvSource
from datacache_helpers import fresh_digests, make_png_dataset, served_digests

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
