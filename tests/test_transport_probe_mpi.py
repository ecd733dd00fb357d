"""mpicomm.transport_probe across 4 ranks: pairs and a chain measure, every rank gets the same figures; odd groups refused."""

from __future__ import annotations

import pytest

from conftest import assert_everywhere
from mpicomm.transport_probe import probe_chain, probe_transport

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def test_every_rank_gets_the_slowest_pairs_finite_figures(world):
    est = probe_transport(world, nbytes=1 << 18, repeats=2, rounds=1)
    table = world.allgather(tuple(est.to_json().values()))  # test-side check only
    ok = len(set(table)) == 1 and est.rate > 0 and est.cpu_per_byte > 0 and est.latency > 0
    assert_everywhere(world, ok, f"estimates per rank: {table}")


def test_an_odd_number_of_ranks_is_refused_on_each_of_them(world):
    sub = world.Split(0 if world.Get_rank() < 3 else 1, world.Get_rank())
    try:
        if world.Get_rank() < 3:
            with pytest.raises(ValueError, match="even number of ranks"):
                probe_transport(sub)
    finally:
        sub.Free()


def test_a_chain_of_streams_gives_every_rank_the_slowest_streams_rate(world):
    """Each rank streams to the next (3 streams on 4 ranks, as a pipeline's stages send on), on a communicator of
    its own: the world's messages are untouched, and the figure is every rank's."""
    out = probe_chain(world, nbytes=1 << 16, count=4, rounds=1)
    table = world.allgather(out["chain_rate"])  # test-side check only
    assert_everywhere(world, len(set(table)) == 1 and table[0] > 0, f"chain rates per rank: {table}")


def test_a_two_way_chain_gives_every_rank_the_slowest_streams_rate(world):
    """Every rank streams to both neighbours at once (6 streams on 4 ranks): its own key, the same figure on every
    rank, and every message delivered (one that never arrived would time the test out)."""
    out = probe_chain(world, nbytes=1 << 16, count=4, rounds=1, two_way=True)
    table = world.allgather(out.get("chain2_rate"))  # test-side check only
    ok = set(out) == {"chain2_rate"} and len(set(table)) == 1 and table[0] > 0
    assert_everywhere(world, ok, f"two-way chain rates per rank: {table}")
