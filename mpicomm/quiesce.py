"""Before a communicator is freed: receive and drop what peers sent on it that nothing will receive."""

# Calls cancelled on every rank, each at its own point (strategy.abort() before a
# clean close), leave messages behind: a ring chunk or a header sent to a peer
# that had already cancelled its receive. Freed with such a message queued, a
# communicator hands it to the next one MPI builds on the same context, whose
# call with that tag would receive it as its own.
#
#     every rank: an end marker (the top tag, no bytes) to every other rank of each communicator
#     then: receive whatever comes, from anyone, until every peer's marker is in
#
# MPI keeps one sender's messages on one communicator in order, so once a
# peer's marker is in, nothing of that peer is left behind. No call of this
# library sends the top tag (mpicomm.tags.end_tag).

from __future__ import annotations

import time
import warnings

import numpy as np
from mpi4py import MPI

from .tags import end_tag

__all__ = ["LIMIT", "quiesce"]

LIMIT = 60.0  # seconds to wait for the peers' markers: they are freeing the same communicators
_EMPTY = np.empty(0, dtype=np.uint8)  # the markers' buffer: global, so a marker freed unsent stays valid


def quiesce(comms: list[MPI.Comm], limit: float = LIMIT) -> int:
    """Collective over each communicator: drop every message still queued for this rank; how many were dropped.

    Posts every marker first and then polls every communicator, so ranks may
    list the communicators in any order. After `limit` seconds it warns with
    the ranks it heard nothing from and returns (what they sent stays queued).
    """
    live = [c for c in comms if c is not None and c != MPI.COMM_NULL and c.Get_size() > 1]
    tags = [end_tag(c) for c in live]
    marks = [c.Isend(_EMPTY, q, tag) for c, tag in zip(live, tags) for q in range(c.Get_size()) if q != c.Get_rank()]
    waiting = [{q for q in range(c.Get_size()) if q != c.Get_rank()} for c in live]
    status, dropped = MPI.Status(), 0
    deadline = time.monotonic() + limit
    while any(waiting) and time.monotonic() < deadline:
        found = False
        for c, tag, peers in zip(live, tags, waiting):
            while peers and (msg := c.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)) is not None:
                found = True
                msg.Recv([np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8), MPI.BYTE])
                if status.Get_tag() == tag:
                    peers.discard(status.Get_source())
                else:
                    dropped += 1
        if not found:
            time.sleep(1e-4)
    for c, peers in zip(live, waiting):
        if peers:
            warnings.warn(f"rank {c.Get_rank()} of a communicator of {c.Get_size()}: no end marker from rank(s) "
                          f"{sorted(peers)} within {limit:.0f} s of freeing it; what they sent, if anything, stays "
                          "queued")
    for req in marks:
        if not req.Test():
            req.Free()  # to a peer that never came: its buffer is global
    return dropped
