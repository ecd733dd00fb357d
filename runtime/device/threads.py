"""What a thread that serves a rank's GPU runs first: that GPU made its current device."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["device_setup"]


def device_setup(device) -> Callable[[], None] | None:
    """torch.cuda.set_device(device) as a callable for a new thread to run first; None off CUDA.

    A thread starts on device 0: without it, on a node with several GPUs, a stream guard or an event
    made there would belong to GPU 0, and its first CUDA call would open a context on GPU 0.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return lambda: torch.cuda.set_device(index)
