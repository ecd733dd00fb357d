"""The simulator fed by the compute model an emulated run waited on: its profile, per measured row."""

from __future__ import annotations

import functools

__all__ = ["emulated", "pipeline_row", "row_profile"]

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
    units = bool(row.get("every_unit"))  # a pipeline's: a layer per unit, as its stages are cut
    key = (row["model"], row["batch_per_rank"], spec, scale, row.get("optimizer", "sgd"), units)
    if key not in _CACHE:
        model = build_model(row["model"])
        inputs, _ = model_input(row["model"], row["batch_per_rank"])
        _CACHE[key] = modelled_profile(model, spec, inputs, row["model"],
                                       optimizer_state=2 if key[4] == "adam" else 1, scale=key[3], every_unit=units)
    return _CACHE[key]


def _spec(row: dict) -> str:
    """The --compute device spec from the row's compute_device (a profile's rows say profile:DEVICE: not known)."""
    dev = row["compute_device"]
    if dev.startswith("profile:"):
        raise ValueError(f"{row['model']}: emulated from a profile, and the row does not say which file "
                         "(rows carry compute_spec since issue 27; rerun the benchmark)")
    amp = ":amp" if "amp" in (row.get("compute") or "") and ":" not in dev else ""
    return dev + amp


def pipeline_row(row: dict) -> dict | None:
    """A jobs.bench.pipeline row as the validation's rows are (strategy, batch_per_rank, and a pipeline's
    microbatches and split over the simulator's layers), or None for a contender with no simulated schedule
    (torch-1f1b). A pipeline's profile is its model at the micro-batch; data parallelism's at the batch over the
    ranks."""
    if row.get("kind") == "peer":
        return None
    out = dict(row, strategy=row["contender"], batch_per_rank=row["batch"] // row["ranks"])
    if row["kind"] == "pipeline":
        # Profiled at the micro-batch, as each stage waits its modelled time for one (not the step's batch
        # divided: a micro-batch of 8 through a 8192 x 8192 layer costs what 64 do, its weights read alike).
        # A layer per unit (parameters or not), so a stage of a ReLU alone, or a cut between a Linear and its
        # ReLU, is simulated as it ran.
        out.update(strategy=f"pipeline-{row['contender']}", batch_per_rank=row["batch"] // row["microbatches"],
                   every_unit=True, sim_options={"microbatches": row["microbatches"], "balance": unit_split(row),
                                                 "per_microbatch": True})
        # How long each send, and each forward's, backward's and update's own work, held a stage's host, as the
        # run measured them: drawn (an op, where longer than its modelled device time).
        drawn = {opt: row[key] for opt, key in (("send_host", "send_host_s"), ("op_host", "op_host_s")) if row.get(key)}
        if drawn:
            from runtime.sim.pipeline import SEEDS

            out["sim_options"].update(drawn, seeds=SEEDS)
    return out


def unit_split(row: dict) -> list[int]:
    """The run's balance (layers of runtime.pipeline.as_layers per stage) as the simulator's layers per stage when
    it has a layer per unit (runtime.emulate.sim_profile's every_unit): the units each stage's layers call."""
    units = _units(row["model"])
    out, a = [], 0
    for n in row["balance"]:
        out.append(sum(units[a:a + n]))
        a += n
    return out


@functools.lru_cache(maxsize=None)
def _units(name: str) -> tuple[int, ...]:
    """Per layer of the model's chain, the units a forward calls in it (runtime.emulate.trace's, on the meta
    device); once a model (fc-heavy: 833 MB of parameters), not once a row."""
    from runtime.emulate.trace import trace
    from runtime.pipeline import as_layers
    from runtime.workloads.models import build_model, model_input

    model = build_model(name)
    layers = as_layers(model)
    inputs, _ = model_input(name, 1)
    where = {id(m): k for k, layer in enumerate(layers) for m in layer.modules()}
    counts = [0] * len(layers)
    for call in trace(model, inputs).calls:
        counts[where[id(call.module)]] += 1
    return tuple(counts)
