"""Requests posted through a RequestLog: counted in flight, cancelled or freed on error paths, none left at exit."""

from __future__ import annotations

import gc
import weakref

import numpy as np
from mpi4py import MPI

from mpicomm.progress import ProgressThread, running
from mpicomm.requests import (RequestLog, abandon, abandoned, cancel_all, drain, drain_at_exit, finish_abandoned,
                              left_posted, live_requests)


def test_counted_until_complete_then_released():
    comm = MPI.COMM_SELF.Dup()
    log = RequestLog()
    before = live_requests()
    out, back = np.arange(4.0), np.zeros(4)
    recv = log.irecv(comm, back, 0, 3)
    assert live_requests() == before + 1 and log.live() == 1
    send = log.isend(comm, out, 0, 3)
    MPI.Request.Waitall([recv, send])
    assert log.live() == 0 and np.array_equal(back, out)
    log.release()
    assert live_requests() == before
    comm.Free()


def test_cancel_drops_receives_that_no_message_will_match():
    comm = MPI.COMM_SELF.Dup()
    log = RequestLog()
    bufs = [np.zeros(8) for _ in range(3)]
    for i, b in enumerate(bufs):
        log.irecv(comm, b, 0, 10 + i)
    assert log.live() == 3
    log.cancel()
    assert log.live() == 0 and live_requests() == 0
    # A later message with the same tag is not swallowed by the cancelled receive.
    got = np.zeros(8)
    req = comm.Irecv(got, 0, 10)
    comm.Send(np.ones(8), 0, 10)
    req.Wait()
    assert np.all(got == 1) and np.all(bufs[0] == 0)
    comm.Free()


def test_a_freed_send_keeps_its_buffer_for_mpi_to_read():
    """The error path frees sends MPI may still be reading: their buffers must outlive the log's references."""
    comm = MPI.COMM_SELF.Dup()
    log = RequestLog("a test's send")
    out = np.full(1 << 20, 3.0)  # 8 MiB that nothing receives yet
    alive = weakref.ref(out)
    log.isend(comm, out, 0, 7)
    log.cancel(grace=0.01)
    del out
    gc.collect()
    assert alive() is not None and live_requests() == 0
    got = np.zeros(1 << 20)
    comm.Recv(got, 0, 7)  # the message still comes whole, read from the kept buffer
    assert np.all(got == 3.0)
    comm.Free()


def test_left_posted_names_the_owner_until_cancelled():
    comm = MPI.COMM_SELF.Dup()
    log = RequestLog("a test's receive")
    log.irecv(comm, np.zeros(2), 0, 5)
    assert left_posted() == {"a test's receive": [0, 1]}
    cancel_all()
    assert left_posted() == {} and live_requests() == 0
    comm.Free()


def test_an_abandoned_collective_is_completed_later():
    comm = MPI.COMM_SELF.Dup()
    req = comm.Ibarrier()
    abandon(req, "a test's barrier", keep=())
    assert finish_abandoned(5.0) == [] and abandoned() == 0 and not req
    comm.Free()


def test_messages_nobody_receives_are_drained_where_marked():
    comm = drain_at_exit(MPI.COMM_SELF.Dup())
    send = comm.Isend(np.ones(3), 0, 4)  # nothing receives it
    assert drain() == 1 and not comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
    send.Wait()
    comm.Free()
    assert drain() == 0  # a freed communicator is skipped


def test_running_progress_threads_are_known_until_stopped():
    thread = ProgressThread("a test's thread")
    assert thread in running()
    thread.stop()
    assert thread not in running()
