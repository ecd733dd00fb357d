"""runtime: the training runtime (data-parallel strategies, optimizer wrapper, timeline) built on mpicomm."""

from .distributed_optimizer import DistributedOptimizer
from .strategies import DEFAULT_SLICE_SIZE, STRATEGIES

__all__ = ["DEFAULT_SLICE_SIZE", "DistributedOptimizer", "STRATEGIES"]
