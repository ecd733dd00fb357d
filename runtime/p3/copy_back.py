"""p3's averages back to the device a few slices at a time, as its exchange completes them."""

from __future__ import annotations

from typing import Callable

__all__ = ["BACK_BYTES", "SliceCopyBack"]

# Finished slices go back in copies of about this size, and at once where one completes a tensor: a tensor larger
# than that (VGG-19's 411 MB fc6) is then mostly on the device when its last slice lands, instead of its whole
# copy starting then (8 ms at 50 GB/s, which the layer's forward waited for: benchmarks/topology.md).
BACK_BYTES = 4 << 20


class SliceCopyBack:
    """Gathers finished slices' ranges of the flat buffers, adjacent ones merged, and hands them to
    `send(tensors, ranges)` once BACK_BYTES have gathered or a slice completes tensors (which may then be waited
    for). Each slice's range goes once a step, no later than the tensors it touches complete; on the exchange's
    polling thread."""

    def __init__(self, slices: list[tuple[int, int, int]], itemsizes: list[int],
                 send: Callable[[list[int], list[tuple[int, int, int]]], None]):
        self.slices, self.itemsizes, self.send = slices, itemsizes, send
        self.ranges: list[tuple[int, int, int]] = []
        self.nbytes = 0

    def reset(self) -> None:
        """A new step (or an aborted one): nothing gathered."""
        self.ranges, self.nbytes = [], 0

    def __call__(self, s: int, finished: list[int]) -> None:
        b, a, z = self.slices[s]
        ranges = self.ranges
        if ranges and ranges[-1][0] == b and ranges[-1][2] == a:
            ranges[-1] = (b, ranges[-1][1], z)
        else:
            ranges.append((b, a, z))
        self.nbytes += (z - a) * self.itemsizes[b]
        if finished or self.nbytes >= BACK_BYTES:
            self.reset()
            self.send(finished, ranges)
