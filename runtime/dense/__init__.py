"""Dense strategies: one fused allreduce after backward, and wait-free backprop over buckets."""

from .allreduce import AllreduceSync
from .wfbp import WfbpSync, buckets

__all__ = ["AllreduceSync", "WfbpSync", "buckets"]
