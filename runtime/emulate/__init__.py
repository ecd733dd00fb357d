"""Emulated accelerators: the real runtime, with each layer's compute replaced by the time a named GPU would take."""

from .accelerator import Accelerator, active, device_time, ready_at, synchronize
from .compute_model import ComputeModel, ProfileModel, RooflineModel, compute_model
from .devices import device, device_names
from .emulated import emulate, emulate_optimizer, emulated_loss, optimizer_state
from .trace import EmulationError
from .watch import ready_aware

__all__ = ["Accelerator", "ComputeModel", "EmulationError", "ProfileModel", "RooflineModel", "active",
           "compute_model", "device", "device_names", "device_time", "emulate", "emulate_optimizer",
           "emulated_loss", "optimizer_state", "ready_aware", "ready_at", "synchronize"]
