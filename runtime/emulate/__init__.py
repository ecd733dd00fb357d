"""Emulated accelerators: the real runtime, with each layer's compute replaced by the time a named GPU would take."""
