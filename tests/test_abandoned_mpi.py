"""Collectives an error path abandons: the memory MPI still writes for them outlives the objects that owned it."""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest
from mpi4py import MPI

from conftest import assert_everywhere
from mpicomm import Ring
from mpicomm.failstop import PeerFailedError
from mpicomm.requests import abandon, finish_abandoned
from mpicomm.step_check import StepCheck

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def test_an_abandoned_allreduce_keeps_its_buffers_until_the_other_ranks_post_theirs(world):
    """mpi4py's Iallreduce request holds no reference to its arrays: abandon() must, or they go with their owner."""
    comm, sync = world.Dup(), world.Dup()
    try:
        if world.Get_rank() == 0:
            send, out = np.arange(8, dtype=np.float64), np.zeros(8)
            alive = [weakref.ref(send), weakref.ref(out)]
            abandon(comm.Iallreduce(send, out, op=MPI.SUM), "a test's allreduce", keep=(send, out))
            del send, out
            gc.collect()
            held = all(ref() is not None for ref in alive)
            sync.Barrier()  # the others post theirs only now
            never = finish_abandoned(10.0)
            released = all(ref() is None for ref in alive)
        else:
            sync.Barrier()
            send, out = np.arange(8, dtype=np.float64), np.zeros(8)
            comm.Iallreduce(send, out, op=MPI.SUM).Wait()  # a blocking Allreduce would not match it
            held, never, released = True, [], True
        assert_everywhere(world, held and released and not never,
                          f"buffers held while pending: {held}, released once complete: {released}, never: {never}")
    finally:
        comm.Free()
        sync.Free()


def test_a_failed_rank_s_joined_round_writes_into_its_own_memory_after_its_step_check_is_gone(world):
    """Rank 0 fails alone: its notice joins a round that the others post only when they hear of it, after rank 0's
    StepCheck is gone. The round's result must land in memory still kept for it, not in arrays allocated since
    (there it corrupted the heap: a crash in the next test's start-up, rarely, seen in CI)."""
    nbits = 5  # a small round: freed, its arrays would be the next ones numpy hands out
    r = world.Get_rank()
    check, sync = StepCheck(world, nbits=nbits), world.Dup()
    elements = check.round_elements
    decoys, heard, never = [], True, []
    try:
        if r == 0:
            check.notify_failure("a test's failure")  # the beacons go out, one round is joined: pending here
            check.stop_listening()
            del check
            gc.collect()
            decoys = [np.full(elements, -7, dtype=np.int64) for _ in range(64)]
            sync.Barrier()
        else:
            sync.Barrier()
            heard, deadline = False, time.monotonic() + 20.0
            while not heard and time.monotonic() < deadline:
                try:
                    check.interrupt(late=False)  # the beacon: this rank joins the round and raises
                    time.sleep(1e-3)
                except PeerFailedError:
                    heard = True
            check.stop_listening()
        never = finish_abandoned(10.0)
        spoilt = sum(int((d != -7).any()) for d in decoys)
        assert_everywhere(world, heard and not never and not spoilt,
                          f"heard the notice: {heard}; rounds never completed: {never}; "
                          f"arrays allocated after the StepCheck went that MPI wrote into: {spoilt}")
    finally:
        sync.Free()


def test_a_cancelled_native_allreduce_writes_into_its_own_memory_after_its_array_is_dropped(world):
    """Rank 0 cancels a latency-path allreduce (MPI's own Iallreduce) and drops its array before the others post
    theirs: the sum lands in that array, still kept for MPI, not in arrays allocated since."""
    ring, sync = Ring(world, validate=False), world.Dup()
    decoys, got = [], None
    try:
        if world.Get_rank() == 0:
            buf = np.ones(6)
            handle = ring.allreduce(buf)
            handle.cancel()
            del buf, handle
            gc.collect()
            decoys = [np.full(6, -7.0) for _ in range(64)]
            sync.Barrier()
        else:
            sync.Barrier()
            got = ring.allreduce(np.ones(6)).wait()
        never = finish_abandoned(10.0)
        spoilt = sum(int((d != -7.0).any()) for d in decoys)
        right = got is None or bool((got == world.Get_size()).all())
        assert_everywhere(world, right and not never and not spoilt,
                          f"sum {got}; never completed: {never}; arrays allocated since that MPI wrote into: {spoilt}")
    finally:
        ring.free()
        sync.Free()
