"""Emulated accelerators."""
