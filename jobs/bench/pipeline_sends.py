"""The pipeline benchmark's record of how long each send held a stage's host, per stage: what the simulator draws."""

from __future__ import annotations

__all__ = ["QUANTILES", "quantiles", "per_stage"]

QUANTILES = 21  # equally spaced, minimum to maximum: every 5 %


def quantiles(samples: list[float], points: int = QUANTILES) -> list[float] | None:
    """`points` equally spaced quantiles of the samples (linear between order statistics), None for none."""
    import numpy as np

    return np.quantile(samples, np.linspace(0.0, 1.0, points)).tolist() if samples else None


def per_stage(comm, rounds: list[dict]) -> list[dict]:
    """Collective over the pipeline's ranks (stage = rank): each stage's {"act": q, "grad": q} (seconds; None where
    it sends none that way) over every round's timed window (each round's "sends": Pipeline.send_times)."""
    mine = {d: quantiles([s for r in rounds for s in r.get("sends", {}).get(d, [])]) for d in ("act", "grad")}
    return comm.allgather(mine)
