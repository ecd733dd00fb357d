"""P3: priority-based slices through a sharded parameter server, updates gated layer by layer in forward."""

from .forward_gate import ForwardGate
from .strategy import P3Sync

__all__ = ["ForwardGate", "P3Sync"]
