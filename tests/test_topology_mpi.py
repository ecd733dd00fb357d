"""Node and cross communicators, detected and emulated, and clear errors for unusable layouts."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

from mpicomm import Topology, TopologyError

pytestmark = pytest.mark.mpi


def members(comm, world):
    """World ranks of `comm`, in comm-rank order."""
    out = np.empty(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([world.Get_rank()], dtype=np.int64), out)
    return out.tolist()


def check_consistent(topo, world):
    P = world.Get_size()
    assert topo.num_nodes * topo.local_size == P
    assert members(topo.node, world) == topo.node_ranks
    assert topo.node_ranks[topo.local_rank] == world.Get_rank()
    # cross: the rank with my local rank on every node, ordered by node
    assert members(topo.cross, world) == [node[topo.local_rank] for node in topo.nodes]
    assert topo.cross.Get_rank() == topo.node_index
    assert sorted(r for node in topo.nodes for r in node) == list(range(P))


def test_detected_layout_matches_launcher(world):
    """MPITRAIN_EXPECT_NODES is set by `make test` for the emulated 2 nodes x 2 ranks runs."""
    with Topology(world) as topo:
        check_consistent(topo, world)
        expected = int(os.environ.get("MPITRAIN_EXPECT_NODES", "1"))
        assert topo.num_nodes == expected, topo
        if expected == 2 and world.Get_size() == 4:
            assert topo.nodes == [[0, 1], [2, 3]]
            assert members(topo.cross, world) == ([0, 2] if topo.local_rank == 0 else [1, 3])


@pytest.mark.parametrize("rpn", [1, 2, 4])
def test_ranks_per_node_override(world, rpn):
    P = world.Get_size()
    if P % rpn:
        pytest.skip(f"world of {P} not divisible by {rpn}")
    with Topology(world, ranks_per_node=rpn) as topo:
        check_consistent(topo, world)
        assert topo.emulated and topo.local_size == rpn and topo.num_nodes == P // rpn
        assert topo.nodes == [list(range(i, i + rpn)) for i in range(0, P, rpn)]


def test_env_override(world, monkeypatch):
    monkeypatch.setenv("MPITRAIN_RANKS_PER_NODE", "1")
    with Topology(world) as topo:
        assert topo.num_nodes == world.Get_size()


def test_not_divisible(world):
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    with pytest.raises(TopologyError, match=f"world size {world.Get_size()} is not divisible"):
        Topology(world, ranks_per_node=world.Get_size() + 1)
    with pytest.raises(TopologyError, match="positive"):
        Topology(world, ranks_per_node=0)


def test_ranks_disagree_on_layout(world, monkeypatch):
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    monkeypatch.setenv("MPITRAIN_RANKS_PER_NODE", "2" if world.Get_rank() == 0 else "1")
    with pytest.raises(TopologyError, match="ranks disagree on ranks_per_node"):
        Topology(world)
    monkeypatch.setenv("MPITRAIN_RANKS_PER_NODE", "two")
    with pytest.raises(TopologyError, match="positive integer, got two"):
        Topology(world)


def test_free_releases_every_communicator(world):
    topo = Topology(world, ranks_per_node=1)
    topo.free()
    assert topo.world == MPI.COMM_NULL and topo.node == MPI.COMM_NULL and topo.cross == MPI.COMM_NULL
