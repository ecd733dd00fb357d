"""Poseidon's hybrid communication: sufficient-factor broadcasting or a ring allreduce per Linear layer, by a cost model."""

from .strategy import HybCommSync

__all__ = ["HybCommSync"]
