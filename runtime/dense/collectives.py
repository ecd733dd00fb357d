"""The dense strategies' allreduce: mpicomm.Collectives with the algorithm asked, its auto choice told the link."""

from __future__ import annotations

from mpicomm import Collectives
from mpicomm.algorithms import CostModel

__all__ = ["dense_collectives"]


def dense_collectives(ctx) -> Collectives:
    """Unvalidated (shapes and call order were agreed when wrapping and are checked every step).

    With auto or the hierarchy on several nodes the cost model gets the measured link (or
    $MPITRAIN_LINK_BANDWIDTH): the crossovers between the algorithms, and the hierarchy's cross-node step, move
    with the link's rate. A registered subclass's options may lack `algorithm` and `node_window`.
    """
    algorithm = getattr(ctx.options, "algorithm", None)
    model = CostModel.for_algorithm(ctx.topology, algorithm)
    return Collectives(ctx.topology, algorithm=algorithm, model=model, validate=False,
                       node_window=getattr(ctx.options, "node_window", "auto"))

