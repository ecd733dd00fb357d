"""The simulator fed by the compute model an emulated run waited on: its profile, per measured row."""

from __future__ import annotations

__all__ = ["emulated", "row_profile"]

_CACHE: dict = {}


def emulated(row: dict) -> bool:
    """Whether a jobs.bench row ran with emulated compute (jobs.common.compute's compute_device)."""
    return bool(row.get("compute_device"))


def row_profile(row: dict):
    """runtime.sim's Profile of the compute an emulated row ran: its model at its batch per rank under its device
    model, times its compute scale and carry factor (the compute it ran, not the one it reports), from the
    same trace emulate() waits on (runtime.emulate.sim_profile). Built once per (model, batch, device, scale)."""
    from runtime.emulate.sim_profile import modelled_profile
    from runtime.workloads.models import build_model, model_input

    spec = row.get("compute_spec") or _spec(row)
    # jobs.bench's rows give the scale asked; a carried run's ran times its carry factor (jobs.common.carry).
    scale = (row.get("compute_scale") or 1.0) * (row.get("carry_factor") or 1.0)
    key = (row["model"], row["batch_per_rank"], spec, scale, row.get("optimizer", "sgd"))
    if key not in _CACHE:
        model = build_model(row["model"])
        inputs, _ = model_input(row["model"], row["batch_per_rank"])
        _CACHE[key] = modelled_profile(model, spec, inputs, row["model"],
                                       optimizer_state=2 if key[4] == "adam" else 1, scale=key[3])
    return _CACHE[key]


def _spec(row: dict) -> str:
    """The --compute device spec from the row's compute_device (a profile's rows say profile:DEVICE: not known)."""
    dev = row["compute_device"]
    if dev.startswith("profile:"):
        raise ValueError(f"{row['model']}: emulated from a profile, and the row does not say which file "
                         "(rows carry compute_spec since issue 27; rerun the benchmark)")
    amp = ":amp" if "amp" in (row.get("compute") or "") and ":" not in dev else ""
    return dev + amp
