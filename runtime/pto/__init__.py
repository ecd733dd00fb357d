"""PTO (MSTopK paper): each rank updates its 1/P of the parameters and optimizer state, then an allgather."""

from .sharded import ShardedUpdate

__all__ = ["ShardedUpdate"]
