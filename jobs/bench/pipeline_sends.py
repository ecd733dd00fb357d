"""How long a stage's sends and ops held its host, per stage, in the pipeline benchmark's rows (simulator draws)."""

from __future__ import annotations

__all__ = ["QUANTILES", "quantiles", "host_times"]

QUANTILES = 21  # equally spaced, minimum to maximum: every 5 %


def quantiles(samples: list[float], points: int = QUANTILES) -> list[float] | None:
    """`points` equally spaced quantiles of the samples (linear between order statistics), None for none."""
    import numpy as np

    return np.quantile(samples, np.linspace(0.0, 1.0, points)).tolist() if samples else None


def host_times(comm, rounds: list[dict]) -> dict:
    """Collective over the pipeline's ranks (stage = rank), over every round's timed window, in seconds:
    send_host_s, each stage's {"act": q, "grad": q} (each round's "sends": Pipeline.send_times), and op_host_s,
    each stage's {"F": q, "B": q, "U": q} (its "ops": Pipeline.op_times, beyond the emulated device's sleeps);
    None where a stage has none of a kind."""
    from runtime.pipeline.host_times import OPS

    def mine(key, kinds):
        return {k: quantiles([s for r in rounds for s in r.get(key, {}).get(k, [])]) for k in kinds}
    stages = comm.allgather((mine("sends", ("act", "grad")), mine("ops", OPS)))
    return {"send_host_s": [s for s, _ in stages], "op_host_s": [o for _, o in stages]}
