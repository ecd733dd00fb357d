"""runtime: the training runtime (data-parallel strategies, optimizer wrapper, timeline) built on mpicomm."""

from .distributed_optimizer import DistributedOptimizer
from .sparse_strategies import SPARSE_STRATEGIES
from .strategies import DEFAULT_SLICE_SIZE, STRATEGIES

__all__ = ["DEFAULT_SLICE_SIZE", "DistributedOptimizer", "SPARSE_STRATEGIES", "STRATEGIES"]
