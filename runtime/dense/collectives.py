"""The dense strategies' allreduce: mpicomm.Collectives with the algorithm asked, its auto choice told the link."""

from __future__ import annotations

from mpicomm import Collectives
from mpicomm.algorithms import CostModel

__all__ = ["dense_collectives", "link_model"]


def dense_collectives(ctx) -> Collectives:
    """Unvalidated (shapes and call order were agreed when wrapping and are checked every step).

    With auto on several nodes the cost model gets the measured link (or $MPITRAIN_LINK_BANDWIDTH): the
    crossovers between the algorithms move with the link's rate. A registered subclass's options may lack
    `algorithm`.
    """
    algorithm = getattr(ctx.options, "algorithm", None)
    return Collectives(ctx.topology, algorithm=algorithm, model=link_model(ctx.topology, algorithm), validate=False)


def link_model(topology, algorithm: str | None) -> CostModel:
    """Collective on several nodes: the cost model the dense strategies' auto choice takes, told the measured link
    (probed once per process, agreed by every rank); with a named algorithm the model is not asked, its defaults."""
    return CostModel.measured(topology) if algorithm in (None, "auto") else CostModel.from_env()
