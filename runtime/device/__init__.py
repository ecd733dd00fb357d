"""Models on GPUs: one device per rank, gradients staged through pinned host memory for MPI, batches fed pinned."""

from .emulated_staging import EmulatedStaging
from .feed import DeviceFeed
from .placement import (STAGING_ENV, describe_transport, gradient_hook, gradient_staging, model_device,
                        staging_wanted)
from .staging import GradientStaging

__all__ = ["DeviceFeed", "EmulatedStaging", "GradientStaging", "STAGING_ENV", "describe_transport", "gradient_hook",
           "gradient_staging", "model_device", "staging_wanted"]
