"""The dense strategies' allreduce: mpicomm.Collectives with the algorithm asked, its auto choice told the link."""

from __future__ import annotations

from mpicomm import Collectives
from mpicomm.algorithms import CostModel

__all__ = ["dense_collectives", "link_model"]


def dense_collectives(ctx) -> Collectives:
    """Unvalidated (shapes and call order were agreed when wrapping and are checked every step).

    With auto or the hierarchy on several nodes the cost model gets the measured link (or
    $MPITRAIN_LINK_BANDWIDTH): the crossovers between the algorithms, and the hierarchy's cross-node step, move
    with the link's rate. A registered subclass's options may lack
    `algorithm`.
    """
    algorithm = getattr(ctx.options, "algorithm", None)
    return Collectives(ctx.topology, algorithm=algorithm, model=link_model(ctx.topology, algorithm), validate=False)


def link_model(topology, algorithm: str | None) -> CostModel:
    """Collective on several nodes: the cost model the dense strategies' auto choice takes, told the measured link
    (probed once per process, agreed by every rank). The named hierarchy asks it too, for its cross-node step's
    algorithm (by the defaults, 10 Gbit/s and 70 us, it took another one on 4 hosts x 2 at 1 Gbit/s, 1.45x slower
    at 256 KiB: benchmarks/topology.md); the other named algorithms never ask it: its defaults."""
    return CostModel.measured(topology) if algorithm in (None, "auto", "hierarchical") else CostModel.from_env()
