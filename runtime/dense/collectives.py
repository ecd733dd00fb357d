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
    """The cost model the dense strategies' Collectives get (mpicomm.algorithms.CostModel.for_algorithm): the
    measured link (probed once per process, agreed by every rank) for auto and the hierarchy."""
    return CostModel.for_algorithm(topology, algorithm)
