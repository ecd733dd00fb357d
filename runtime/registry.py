"""Strategy names to the classes that implement them."""

from __future__ import annotations

from .dense import AllreduceSync, WfbpSync
from .hybrid import HybCommSync
from .p3 import P3Sync
from .sparse import HierTopkSync, TopkSync

STRATEGIES = {"allreduce": AllreduceSync, "wfbp": WfbpSync, "p3": P3Sync, "hybcomm": HybCommSync}
SPARSE_STRATEGIES = {"topk": TopkSync, "hier-topk": HierTopkSync}
ALL_STRATEGIES = {**STRATEGIES, **SPARSE_STRATEGIES}


def strategy_class(name: str):
    try:
        return ALL_STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r} (choose from {', '.join(ALL_STRATEGIES)})") from None


def register_strategy(name: str, cls) -> None:
    """Make a Strategy subclass available under `name` (an options object whose .name is `name` selects it)."""
    if name in ALL_STRATEGIES and ALL_STRATEGIES[name] is not cls:
        raise ValueError(f"a strategy named {name!r} exists already")
    ALL_STRATEGIES[name] = cls
