"""A model's profile taken by jobs.sim.worker on ranks of this host, for the projection and the validation."""

from __future__ import annotations

import os
import sys


def take_profile(model: str, ranks: int, out: str, batch_size: int = 16, timeout: float = 1800,
                 device: str = "cpu") -> dict:
    """jobs.sim.worker profile on `ranks` ranks of this host (on GPUs: rank i on GPU i % GPUs); its ROW."""
    from jobs.common.cluster_sweep import rows_from
    from mpicomm.emulation import run_local

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    cmd = [sys.executable, "-m", "jobs.sim.worker", "profile", "--model", model, "--batch-size", str(batch_size),
           "--out", out, "--device", device]
    return rows_from(run_local(cmd, ranks, timeout, capture=True))[0]
