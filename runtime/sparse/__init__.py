"""Sparse strategies: MSTopK selection, error feedback, flat and hierarchical top-k exchange."""

from .error_feedback import DensitySchedule, ErrorFeedback
from .mstopk import MSTopK
from .selection import exact_topk
from .strategy import HierTopkSync, NonFiniteGradientError, TopkSync

__all__ = ["DensitySchedule", "ErrorFeedback", "HierTopkSync", "MSTopK", "NonFiniteGradientError", "TopkSync",
           "exact_topk"]
