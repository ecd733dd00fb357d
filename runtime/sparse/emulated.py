"""Top-k selection under emulated compute: the device's time waited, the positions of the fixed gradient's top k reused."""

from __future__ import annotations

import torch

from .selection import k_for_density


class EmulatedSelection:
    """What a rank's selection sends under emulation (runtime.emulate), without scanning n elements per step.

    An emulated model hands every parameter the same gradient each step (its
    `_emulated_grad`), so the vector a rank selects from is the same each
    step too. The first call for a key (a dtype's buffer, a layer, a node
    shard) finds its top k once (torch.topk, sorted, on the host); every
    call then waits the device's modelled selection time (select_s(n):
    MSTopK's threshold passes with error feedback and velocity), takes the
    first k of those positions and gathers the current values there (k
    elements). Faithful for throughput: each rank sends exactly the k
    (index, value) pairs of its density, at the real index and value widths,
    with the positions real top-k picks on that gradient (the largest
    magnitudes, spread over the tensor as the fixed gradient's are), so the
    exchange, the scatter-add of every rank's pairs and the update cost what
    they cost in training. Not the same values: error feedback and the
    velocity are not kept (their passes are in select_s), so later steps do
    not rotate through the entries that real error feedback would promote,
    and ranks of one emulated model share the fixed gradient, so their
    selections coincide (P*k pairs are still sent and summed).
    """

    def __init__(self, acc):
        self.acc = acc
        self._order: dict = {}  # key -> (n, positions of the largest |x| first, as many as the largest k asked)

    def select(self, key, x: torch.Tensor, density: float, from_host: bool = False):
        """(values, indices) of k = density * n entries of x; from_host: x is this rank's shard of a node
        reduce-scatter on the host, copied to the device first (hier-topk)."""
        n, width = x.numel(), x.element_size()
        k = k_for_density(n, density)
        acc, model = self.acc, self.acc.model
        if from_host:
            acc.issue("h2d", model.copy_s(n * width))
        acc.issue("select", model.select_s(n))
        known = self._order.get(key)
        if known is None or known[0] != n or known[1].numel() < k:
            # Once per key (and when a density ramp asks for more): sorted, so any smaller k is a prefix.
            known = self._order[key] = (n, largest_first(x.detach(), k))
        indices = known[1][:k]
        # The pairs go to pinned host memory for MPI: values and indices at the values' width.
        acc.issue("d2h", model.copy_s(2 * k * width))
        return x.detach()[indices], indices

    def clear(self) -> None:
        self._order.clear()


CHUNK = 1 << 22  # elements per piece of largest_first's scan


def largest_first(x: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of x's k largest magnitudes, largest first, as torch.topk(|x|, k, sorted=True) gives them
    (among equal magnitudes perhaps others), found piece by piece: the k largest of x are among the k largest of
    each piece. One torch.topk over the whole vector held its n (value, index) pairs at once (VGG-19: 1.7 GB a
    rank on the host, where eight ranks share 23.5 GB)."""
    n = x.numel()
    if n <= CHUNK:
        return torch.topk(x.abs(), k, sorted=True).indices
    values, positions = [], []
    for a in range(0, n, CHUNK):
        piece = x[a:a + CHUNK].abs()
        top = torch.topk(piece, min(k, piece.numel()), sorted=False)
        values.append(top.values)
        positions.append(top.indices + a)
    values, positions = torch.cat(values), torch.cat(positions)
    return positions[torch.topk(values, k, sorted=True).indices]
