"""Requests posted through a RequestLog are counted while in flight, and cancelled or freed on error paths."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpicomm.requests import RequestLog, live_requests


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
