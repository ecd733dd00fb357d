"""The cluster simulator: measured per-layer profiles replayed through a fluid model of links and cores."""

from .cluster import Cluster, ClusterError
from .profile import Layer, Profile, ProfileError
from .simulate import SCHEDULES, Result, UnknownStrategyError, simulate

__all__ = ["Cluster", "ClusterError", "Layer", "Profile", "ProfileError", "Result", "SCHEDULES",
           "UnknownStrategyError", "simulate"]
