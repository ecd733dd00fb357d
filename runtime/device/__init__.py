"""Models on GPUs: one device per rank, gradients staged through pinned host memory for MPI, batches fed pinned."""

from .feed import DeviceFeed
from .placement import STAGING_ENV, describe_transport, model_device, staging_wanted
from .staging import GradientStaging

__all__ = ["DeviceFeed", "GradientStaging", "STAGING_ENV", "describe_transport", "model_device", "staging_wanted"]
