"""Freeing a communicator drops what nobody received on it, so that MPI's next one is handed nothing stale."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI

from conftest import assert_everywhere, queued
from mpicomm import Ring
from mpicomm.quiesce import quiesce
from mpicomm.tags import end_tag

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]
KEPT: list = []  # a send that failed to complete, with its buffer: MPI may still read it


@pytest.mark.parametrize("nbytes", [16, 4 << 20], ids=["eager", "rendezvous"])
def test_a_message_nobody_received_is_not_handed_to_the_next_ring(world, nbytes):
    """Each rank sends its right neighbour a message that nothing receives (a cancelled call's chunk), then frees
    the ring: the next ring built on the same parent sees nothing of it, and the send completes (its peer
    received it to drop it)."""
    r, size = world.Get_rank(), world.Get_size()
    ring = Ring(world, validate=False)
    payload = np.full(nbytes, r, dtype=np.uint8)
    sent = ring.comm.Isend(payload, (r + 1) % size, 7)
    ring.free()
    deadline = time.monotonic() + 5
    while not (done := sent.Test()) and time.monotonic() < deadline:
        time.sleep(1e-3)  # a large send completes once MPI here has heard its peer is through
    with Ring(world, validate=False) as again:
        world.Barrier()
        time.sleep(0.2)  # a message still on its way would land by now
        stale = queued([again.comm])
        assert_everywhere(world, not stale and (done or size == 1), f"stale {stale}, send completed: {done}")
    if not done:
        KEPT.append((sent, payload))


def test_a_peer_that_never_quiesces_is_named_and_nobody_waits_for_ever(world):
    """Rank 0 quiesces a communicator of ranks 0 and 1 alone: after its limit it warns, naming rank 1."""
    if world.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    r = world.Get_rank()
    pair = world.Split(0 if r < 2 else MPI.UNDEFINED, r)
    said, dropped = [], 0
    if r == 0:
        with warnings.catch_warnings(record=True) as caught:  # checked on every rank below, not raised here alone
            warnings.simplefilter("always")
            quiesce([pair], limit=0.2)
        said = [str(w.message) for w in caught]
    world.Barrier()
    if r == 1:
        dropped = quiesce([pair])  # rank 0's marker is in: at once, and nothing else
    if r == 0:
        pair.Recv([np.empty(0, dtype=np.uint8), MPI.BYTE], 1, end_tag(pair))  # rank 1's, sent after the limit
    named = len(said) == 1 and "no end marker from rank(s) [1] within 0 s" in said[0]
    assert_everywhere(world, (r != 0 or named) and dropped == 0, f"warnings {said}, dropped {dropped}")
    if pair != MPI.COMM_NULL:
        pair.Free()
