"""A Topology over the first P world ranks with L ranks per emulated node, for layout-parametrized MPI tests."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from mpi4py import MPI

from mpicomm import Topology


@contextmanager
def sub_topology(world, P: int, L: int):
    """(comm, topology) of the first P ranks, nodes of L consecutive ranks; the other ranks skip the test."""
    if P > world.Get_size():
        pytest.skip(f"needs {P} ranks")
    comm = world.Split(0 if world.Get_rank() < P else MPI.UNDEFINED, world.Get_rank())
    if comm == MPI.COMM_NULL:
        pytest.skip(f"rank outside the {P}-rank group")
    topo = Topology(comm, ranks_per_node=L)
    try:
        yield comm, topo
    finally:
        topo.free()
        comm.Free()
