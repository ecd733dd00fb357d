"""Simulate one strategy on one cluster from a profile: the steady-state time per training step."""

from __future__ import annotations

from dataclasses import dataclass

from mpicomm.algorithms import CHOICES
from runtime.p3.online_credit import CreditTrials, fastest
from runtime.p3.tuning import AUTO, ONLINE

from .cluster import Cluster
from .dataparallel import AllreduceSchedule, BucketSchedule, DdpSchedule, Run, Schedule, TopkSchedule, train
from .hybrid import HybcommSchedule
from .p3 import P3Schedule, p3_settings
from .pipeline import MODES as PIPELINE_MODES, simulate_pipeline
from .profile import Profile

# jobs.bench's contender names -> (schedule, options). "+pto" may follow allreduce.
SCHEDULES = {
    "compute": (Schedule, {}),
    "allreduce": (AllreduceSchedule, {}),
    "allreduce+pto": (AllreduceSchedule, {"pto": True}),
    "wfbp": (BucketSchedule, {}),
    "ddp": (DdpSchedule, {}),
    "p3": (P3Schedule, {}),
    "p3-flat": (P3Schedule, {"node_aggregation": False}),  # every rank pushes its own slices across
    "p3-yield": (P3Schedule, {"yield_link": True}),  # holds its sends while the step's small collectives cross
    "hybcomm": (HybcommSchedule, {}),
    "hybcomm-sfb": (HybcommSchedule, {"force": "sfb"}),
    "hybcomm-ps": (HybcommSchedule, {"force": "ps"}),
    "topk": (TopkSchedule, {}),
    "hier-topk": (TopkSchedule, {"hierarchical": True}),
}
STEPS = 6  # simulated steps; the first two (start-up, p3's first exchange) are left out of the average


class UnknownStrategyError(ValueError):
    """A strategy name the simulator has no schedule for."""


@dataclass(frozen=True)
class Result:
    strategy: str
    t_iter_s: float
    cluster: str
    events: int  # rate re-sharings: what the simulation cost
    details: dict

    @property
    def samples_per_s(self) -> float:
        return 0.0 if not self.t_iter_s else self.details["samples_per_step"] / self.t_iter_s


def schedule_for(name: str):
    if name.startswith("pipeline-") and name.removeprefix("pipeline-") in PIPELINE_MODES:
        return simulate_pipeline, {"mode": name.removeprefix("pipeline-")}
    if name.startswith("p3@"):
        slice_size, _, credit = name.removeprefix("p3@").partition("/")
        as_opt = lambda v: v if v in (AUTO, ONLINE) else int(v)  # noqa: E731
        return P3Schedule, {"slice_size": as_opt(slice_size), "credit": as_opt(credit)}
    base, _, algorithm = name.partition("@")
    if algorithm and base in ("allreduce", "wfbp"):  # "wfbp@ring": the contender whose allreduce takes one algorithm
        if algorithm not in CHOICES:
            raise UnknownStrategyError(f"{name!r}: the allreduce algorithm must be one of {', '.join(CHOICES)}")
        cls, defaults = SCHEDULES[base]
        return cls, {**defaults, "algorithm": algorithm}
    if name not in SCHEDULES:
        raise UnknownStrategyError(f"no simulated schedule for {name!r} (have {', '.join(SCHEDULES)}, "
                                   f"p3@SLICE/CREDIT, allreduce@ALGORITHM, wfbp@ALGORITHM, "
                                   f"{', '.join('pipeline-' + m for m in PIPELINE_MODES)})")
    return SCHEDULES[name]


def simulate(profile: Profile, cluster: Cluster, strategy: str, steps: int = STEPS, **options) -> Result:
    """Simulate `steps` steps of `strategy`; T_iter is the mean step over all but the first two."""
    cls, defaults = schedule_for(strategy)
    if cls is simulate_pipeline:  # options: microbatches, stages
        opts = {"microbatches": 4, **defaults, **options}
        t_iter, split = simulate_pipeline(profile, cluster, steps=steps, **opts)
        per_step = profile.batch_size * (opts["microbatches"] if opts.get("per_microbatch") else 1)
        return Result(strategy, t_iter, cluster.describe(), 0,
                      {"samples_per_step": per_step * cluster.ranks // len(split), "ranks": cluster.ranks,
                       "stages": [f"{r.start}-{r.stop - 1}" for r in split], "microbatches": opts["microbatches"]})
    options = {**defaults, **options}
    if cls is P3Schedule and options.get("credit") == ONLINE:
        return _online_credit(profile, cluster, strategy, steps, options)
    run = Run(profile, cluster)
    schedule = cls(run, **options)
    ends = train(run, schedule, steps)
    skip = 2 if steps > 3 else 1 if steps > 1 else 0
    t_iter = (ends[-1] - ends[skip - 1]) / (steps - skip) if skip else ends[-1]
    details = {"samples_per_step": profile.batch_size * cluster.ranks, "ranks": cluster.ranks}
    if isinstance(schedule, P3Schedule):
        details["p3"] = schedule.tuning.describe(profile.itemsize)
        details["messages"] = schedule.messages
    if isinstance(schedule, HybcommSchedule):
        details["plan"] = schedule.plan
    return Result(strategy, t_iter, cluster.describe(), run.engine.events, details)


def _online_credit(profile: Profile, cluster: Cluster, strategy: str, steps: int, options: dict) -> Result:
    """p3 with credit "online" once its trials are over: each credit the runtime tries, simulated, and the one
    its rule keeps (runtime.p3.online_credit.fastest); the trial steps themselves are not in T_iter."""
    start = p3_settings(Run(profile, cluster), options.get("slice_size", AUTO), ONLINE)
    trials = CreditTrials(start.credit)
    tried = {c: simulate(profile, cluster, "p3", steps, **{**options, "credit": c}) for c in trials.order}
    chosen = fastest({c: [r.t_iter_s] for c, r in tried.items()}, trials.order)
    best = tried[chosen]
    figures = ", ".join(f"{c} {1e3 * r.t_iter_s:.2f} ms" for c, r in tried.items())
    said = f"{start.describe(profile.itemsize)}; credit online: {figures}; chose {chosen}"
    details = {**best.details, "p3": said,
               "credit_tried": {str(c): r.t_iter_s for c, r in tried.items()}, "credit_chosen": chosen}
    return Result(strategy, best.t_iter_s, best.cluster, sum(r.events for r in tried.values()), details)
