"""hybcomm's per-layer plan (sufficient factors or parameter server) as JSON rows and text, for the jobs."""

from __future__ import annotations

import dataclasses

# What a benchmark row keeps of each layer (jobs.train keeps every field of runtime.hybrid.cost_model.LayerCost).
PLAN_KEYS = ("name", "M", "N", "K", "choice", "reason")


def plan_rows(strategy, keys: tuple[str, ...] | None = None) -> list[dict] | None:
    """strategy.plan as dicts (every field, or `keys`); None for a strategy without a plan, or before its first step."""
    plan = getattr(strategy, "plan", None)
    if plan is None:
        return None
    rows = []
    for layer in plan:
        if keys is not None:
            fields = {k: getattr(layer, k) for k in keys}
        else:
            fields = dataclasses.asdict(layer) if dataclasses.is_dataclass(layer) else dict(vars(layer))
        # numpy and torch scalars have .item(); json would refuse them.
        rows.append({k: v.item() if hasattr(v, "item") else v for k, v in fields.items()})
    return rows


def plan_markdown(rows: list[dict]) -> str:
    """A plan's rows (PLAN_KEYS) as a markdown table."""
    head = "| layer | M | N | K | choice | reason |\n|---|---:|---:|---:|---|---|"
    return "\n".join([head, *(f"| {r['name']} | {r['M']} | {r['N']} | {r['K']} | {r['choice']} | {r['reason']} |"
                              for r in rows)])


class PlanWatch:
    """Prints the plan after the first step and again whenever the strategy recomputes it (plan_version grows)."""

    def __init__(self, strategy, say=print):
        self.strategy, self.say, self.version = strategy, say, None

    def check(self) -> None:
        version = getattr(self.strategy, "plan_version", None)
        if version is None or version == self.version or getattr(self.strategy, "plan", None) is None:
            return
        self.version = version
        self.say("hybcomm plan:\n" + self.strategy.plan_text(), flush=True)
