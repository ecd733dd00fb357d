"""runtime: the training runtime on mpicomm: DistributedOptimizer, its strategies, checkpoints, tracing, models."""

from mpicomm import failstop
from mpicomm.failstop import PeerFailedError, PeerInterruptedError
from mpicomm.stall import StallError, StallPolicy
from mpicomm.validate import CollectiveMismatchError

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .comm_hooks import CompressionState, GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .frozen_watch import ParametersChangedError
from .optimizer import DistributedOptimizer
from .options import (AUTO, DEFAULT_FUSE_BYTES, AllreduceOptions, HybCommOptions, P3Options,
                      StrategyOptions, TopkOptions, WfbpOptions)
from .registry import ALL_STRATEGIES, SPARSE_STRATEGIES, STRATEGIES
from .sparse import NonFiniteGradientError

# From here on, one rank's uncaught exception or early exit stops every rank (MPITRAIN_FAILSTOP=0: off).
failstop.install()

__all__ = [
    "ALL_STRATEGIES", "AllreduceOptions", "CheckpointError", "CollectiveMismatchError", "CompressionState",
    "AUTO", "DEFAULT_FUSE_BYTES", "DistributedOptimizer", "GradBucket", "HybCommOptions", "NonFiniteGradientError",
    "P3Options", "ParametersChangedError", "PeerFailedError", "PeerInterruptedError", "SPARSE_STRATEGIES", "STRATEGIES", "StallError",
    "StallPolicy", "StrategyOptions", "TopkOptions", "WfbpOptions", "allreduce_hook", "bf16_compress_hook",
    "fp16_compress_hook", "load_checkpoint", "save_checkpoint",
]
