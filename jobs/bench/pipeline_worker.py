"""The MPI side of jobs.bench.pipeline: pipeline modes vs data parallelism vs torch's pipelining, on one model.

    mpiexec -n 4 mpitrain bench pipeline-worker --model vgg19 --batch-size 64 --microbatches 8
    mpiexec -n 4 mpitrain bench pipeline-worker --model vgg19 --device cuda   # ranks on GPUs (may share one)

Every contender trains the same model (same seed) on the same global batch per step: the
pipeline modes (runtime.pipeline, one stage per rank), the data-parallel strategies
(runtime.DistributedOptimizer allreduce/wfbp/p3, torch DDP; batch / ranks each) and
torch-1f1b (jobs.bench.pipeline_peer: Schedule1F1B over gloo). Pipelines and torch-1f1b share
the micro-batches and one balance, chosen once by rank 0 (PipeDream's partitioner on
one micro-batch, with this link's bandwidth). In each of --rounds rounds every
contender, in a rotating order, is built, warmed up, timed over --iters steps and
destroyed: one alive at a time. A step's time ends when the last rank finished it, no
barrier inside the timed steps; the strategies' synchronize() counts in the last step. The
async modes never drain in training, so their window opens and closes with the pipeline
full and flowing (one untimed step after the barrier, the device's queued update waited
for at both ends) and their final drain() comes after it: each timed step holds one
step's work, as in a long run (counting the drain put up to 10 % on a 2-step window, the
barrier's stall 4 % on a 4-step one). torch-1f1b times its own steps, a barrier before each.
Rank 0 prints a "ROW {json}" per contender (t_iter_rounds_s: each round's T_iter; a pipeline's send_host_s and
op_host_s: per stage, how long each send and op held its host, jobs.bench.pipeline_sends);
jobs.bench.pipeline says what the columns measure. --timeline PATH: a Chrome trace of
the pipeline contenders (each pass, update and wait, per rank). --device cuda: every
contender's model on the rank's GPU (local rank mod the GPUs it sees); torch-1f1b (gloo,
CPU tensors) is left out of the default contenders.
--compute emulated:DEVICE: every contender under the same compute model (runtime.emulate): each
pipeline rank's stage emulated alone at its input's shape (runtime.Pipeline(compute=...)), as is
each torch-1f1b stage before torch's PipelineStage takes it, and data parallelism's whole model;
losses and optimizers emulated; the balance from the modelled layer times. Rows carry the compute
fields (jobs.common.compute.Compute.describe), the kinds of work emulated, and the busiest rank's modelled
device seconds a step (modelled_device_s_max: what T_iter would be if that rank never waited).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

from jobs.bench.host_usage import memory_mb
from jobs.bench.pipeline_sends import host_times
from jobs.common.choices import MODELS, PIPELINE_MODES, SEQUENTIAL_MODELS
from jobs.common.cluster_sweep import print_row
from jobs.common.compute import Compute, add_compute_arguments, check_compute
from jobs.common.outputs import write_timeline
from jobs.common.inputs import (InputError, JobParser, add_device_argument, at_least, check_device, comma_list,
                                launched_ranks, one_of, parse)
from jobs.common.stats import summary

ASYNC_MODES = ("vanilla", "stash", "spectrain")
DATA_PARALLEL = ("allreduce", "wfbp", "p3", "ddp")
PEERS = ("torch-1f1b",)
CONTENDERS = (*PIPELINE_MODES, *DATA_PARALLEL, *PEERS)
LR, MOMENTUM = 0.01, 0.9


def kind(contender: str) -> str:
    return "pipeline" if contender in PIPELINE_MODES else "data-parallel" if contender in DATA_PARALLEL else "peer"


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.pipeline_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vgg19")
    p.add_argument("--contenders", help=f"default {','.join(CONTENDERS)} (without torch-1f1b with --device cuda)")
    add_device_argument(p)
    p.add_argument("--batch-size", type=int, default=64, help="global samples per step, for every contender")
    p.add_argument("--microbatches", type=int, default=8, help="per step, pipelines and torch-1f1b alike")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5, help="timed steps per contender per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender per round")
    p.add_argument("--bandwidth", default="unshaped", help="the link's rate (label in the rows; partitioner)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", help=argparse.SUPPRESS)  # mlp widths, e.g. 64,64,64 (the tests' small model)
    p.add_argument("--timeline", help="Chrome-trace JSON of the pipeline contenders' rounds, one track per rank")
    add_compute_arguments(p)
    return parse(p, argv, check_args, mpi=True)


def check_models(opt: str, models: list[str]) -> None:
    for m in models:
        one_of(opt, m, MODELS)
        if m not in SEQUENTIAL_MODELS:
            raise InputError(opt, f"{m} is not a chain of layers a pipeline can cut "
                                  f"(choose from {', '.join(SEQUENTIAL_MODELS)})")


def check_args(args) -> None:
    check_models("--model", [args.model])
    check_settings(args, [args.model], launched_ranks())


def check_settings(args, models: list[str], ranks: int) -> None:
    """What jobs.bench.pipeline hands the worker, under the same option names; `ranks`: one stage per rank."""
    if args.contenders is None:
        args.contenders = ",".join(c for c in CONTENDERS if args.device == "cpu" or c not in PEERS)
    args.contenders = comma_list("--contenders", args.contenders, CONTENDERS)
    if args.device == "cuda" and "torch-1f1b" in args.contenders:
        raise InputError("--contenders", "torch-1f1b sends CPU tensors over gloo: leave it out with --device cuda")
    at_least(args, 1, "batch_size", "microbatches", "rounds", "iters")
    at_least(args, 0, "warmup", "seed")
    if args.batch_size % args.microbatches:
        raise InputError("--microbatches", f"must divide --batch-size {args.batch_size}, got {args.microbatches}")
    if any(kind(c) == "data-parallel" for c in args.contenders) and args.batch_size % ranks:
        raise InputError("--batch-size", f"data parallelism splits it over the ranks: {args.batch_size} "
                                         f"does not divide by {ranks}")
    if "torch-1f1b" in args.contenders and args.microbatches < ranks:
        raise InputError("--microbatches", f"torch-1f1b needs at least one per stage ({ranks}), "
                                           f"got {args.microbatches}")
    if args.hidden is not None:
        if models != ["mlp"]:
            raise InputError("--hidden", "sets the mlp's widths: only with the mlp model alone")
        args.hidden = comma_list("--hidden", args.hidden, parse=int)
        if min(args.hidden) < 1:
            raise InputError("--hidden", f"widths must be >= 1, got {args.hidden}")
    check_device(args)  # last: it imports torch
    check_compute(args)


class Runner:
    def __init__(self, args):
        import torch
        from mpi4py import MPI

        from mpicomm import Topology
        from runtime.pipeline.staging import stage_device
        from runtime.workloads.models import loss_fn, model_input

        torch.set_num_threads(1)  # the ranks share the cores, as in jobs.bench.strategies_worker
        self.args, self.torch, self.MPI = args, torch, MPI
        self.topo = Topology()
        self.comm, self.P, self.rank = self.topo.world, self.topo.size, self.topo.rank
        self.device = stage_device(args.device, self.topo.local_rank)
        self.loss = loss_fn(args.model)
        # The batches live where the models do: no copy inside the timed steps.
        (self.x,), self.y = model_input(args.model, args.batch_size, args.seed)  # global batch, every rank
        self.x, self.y = self.x.to(self.device), self.y.to(self.device)
        self.dp_inputs, self.dp_target = model_input(args.model, args.batch_size // self.P, args.seed + 1 + self.rank)
        self.dp_inputs = tuple(t.to(self.device) for t in self.dp_inputs)
        self.dp_target = self.dp_target.to(self.device)
        self.iface = os.environ.get("MPITRAIN_CLUSTER_IFACE")  # set by the emulated cluster: alone in a namespace
        self.compute = Compute.from_args(args)
        self.micro = self.x[:args.batch_size // args.microbatches]  # one micro-batch: partition, emulated stages
        self.balance = self._balance()
        self.timeline = None
        if args.timeline:
            from runtime.trace import Timeline
            self.timeline = Timeline(self.rank)

    def build(self):
        from runtime.workloads.models import build_model

        self.torch.manual_seed(self.args.seed)
        return build_model(self.args.model, **({"hidden": self.args.hidden} if self.args.hidden else {}))

    def _balance(self) -> list[int]:
        """Rank 0 profiles the layers on one micro-batch and picks the split for everyone (PipeDream's DP)."""
        from mpicomm.agree import fail_together
        from mpicomm.emulation import EmulationError, parse_bandwidth
        from runtime.pipeline import as_layers, best_balance, plan_table, profile_layers
        from runtime.pipeline.partition import modelled_profile

        balance = problem = None
        if self.rank == 0:
            try:
                bps = parse_bandwidth(self.args.bandwidth)
            except EmulationError:  # a label such as local-unshaped
                bps = None
            try:  # a model of fewer layers than ranks, for one
                layers, c = as_layers(self.build()), self.compute
                profile = modelled_profile(layers, self.micro, c.spec.removeprefix("emulated:"), c.scale) \
                    if c.emulated else profile_layers(layers, self.micro, device=self.device)
                balance = best_balance(profile, self.P, bps)
                print(plan_table(profile, balance, bps), flush=True)
            except ValueError as exc:
                problem = f"{self.args.model} on {self.P} stages: {exc}"
        fail_together(self.comm, problem)
        return self.comm.bcast(balance, root=0)

    def tx_bytes(self) -> int:
        with open(f"/sys/class/net/{self.iface}/statistics/tx_bytes") as f:
            return int(f.read())

    def spread(self, value: float) -> tuple[float, float]:
        """(mean, max) of a value over the ranks."""
        values = self.comm.allgather(value)
        return statistics.fmean(values), max(values)

    def timed(self, step, settle, finish, engine_bytes=lambda: 0, steady: bool = False):
        """Warm up, then (per-step seconds: when the last rank finished each step; tx bytes; engine bytes).

        steady (the async pipelines, never drained: full after the warm-up): the window closes as it opened,
        full and flowing (one untimed step after the barrier that stalled it), so it holds as many steps' work
        as it times; finish()'s drain (the last step's owed backward passes) comes after it, untimed, as
        jobs.bench.strategies_worker leaves p3's owed update out. The device's queued work (an update) is
        waited for at both ends. Bytes likewise.
        """
        import numpy as np

        a, ends = self.args, np.empty(self.args.iters)
        for _ in range(a.warmup):
            step()
        settle()
        if steady:
            self.compute.synchronize(self.device)
        self.comm.Barrier()
        if steady:  # the barrier stalled the pipeline: one step, untimed, to flow again (each rank's window opens
            step()  # after its own step; a step's end is still the slowest rank's)
            self.ran += 1
        tx0, e0 = (self.tx_bytes() if self.iface else 0), engine_bytes()
        count = lambda: (self.tx_bytes() - tx0 if self.iface else None, engine_bytes() - e0)  # noqa: E731
        t0 = time.perf_counter()
        for k in range(a.iters):
            step()
            if k == a.iters - 1:
                if steady:
                    self.compute.synchronize(self.device)
                    ends[k] = time.perf_counter() - t0
                    sent = count()
                    finish()  # the owed backward passes, after the window
                    break
                sent = None
                finish()  # p3's owed update, a data-parallel step's last work
                self.compute.synchronize(self.device)  # its queued work counts too (a GPU's, an emulated one's)
            ends[k] = time.perf_counter() - t0
        sent = sent or count()
        self.comm.Allreduce(self.MPI.IN_PLACE, ends, op=self.MPI.MAX)
        return list(np.diff(ends, prepend=0.0)), *sent

    def pipeline(self, name: str) -> dict:
        from runtime.pipeline import Pipeline, as_layers

        c = self.compute
        emulated = dict(compute=c.spec.removeprefix("emulated:"), compute_scale=c.scale, sample=self.micro) \
            if c.emulated else {}
        pipe = Pipeline(as_layers(self.build()), lambda ps: self.torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM),
                        loss_fn=self.loss, balance=self.balance, microbatches=self.args.microbatches, mode=name,
                        topology=self.topo, device=self.device, say=None, timeline=self.timeline, **emulated)
        clear = lambda: (pipe.send_times(clear=True), pipe.op_times(clear=True))  # noqa: E731
        secs, tx, engine = self.timed(lambda: pipe.train_step(self.x, self.y), clear,
                                      pipe.drain, lambda: pipe.stats()["bytes_sent"], steady=name in ASYNC_MODES)
        st, mem, sends, ops = pipe.stats(), memory_mb(), pipe.send_times(), pipe.op_times()  # from the warm-up's end
        pipe.close()
        return dict(secs=secs, tx=tx, engine=engine, mem=mem, weight_copy_bytes=st["weight_copy_bytes"], ops=ops,
                    parameter_bytes=st["parameter_bytes"], updates_per_step=st["updates"] / pipe.steps, sends=sends)

    def data_parallel(self, name: str) -> dict:
        # Emulated (or not) before DDP or a strategy hooks into it; the same compute model as the pipelines'.
        model = self.compute.model(self.build().to(self.device), self.dp_inputs)
        opt = self.compute.optimizer(self.torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        loss = self.compute.loss(self.loss)

        def steps(net, o):
            def step():
                o.zero_grad()
                loss(net(*self.dp_inputs), self.dp_target).backward()
                o.step()
            return step
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            ddp = DDP(model, device_ids=ids, gradient_as_bucket_view=True)  # no copies into its buckets and back
            secs, tx, _ = self.timed(steps(ddp, opt), lambda: None, lambda: None)
            mem = memory_mb()
        else:
            from runtime import DistributedOptimizer

            with DistributedOptimizer(opt, model, name, topology=self.topo) as dopt:
                secs, tx, _ = self.timed(steps(model, dopt), dopt.synchronize, dopt.synchronize)
                mem = memory_mb()
        # Without a wire to read: a ring allreduce's share, 2 (P - 1) / P x the gradient, per rank.
        return dict(secs=secs, tx=tx, engine=2 * (self.P - 1) / self.P * grad_bytes * self.args.iters, mem=mem,
                    parameter_bytes=grad_bytes, updates_per_step=1)

    def peer(self, name: str) -> dict:
        from torch import nn

        from jobs.bench.pipeline_peer import Contiguous, run_peer
        from runtime.pipeline import as_layers
        from runtime.pipeline.emulation import stage_input

        a, b = sum(self.balance[:self.rank]), sum(self.balance[:self.rank + 1])
        full = as_layers(self.build())
        example = stage_input(full, a, self.micro) if self.compute.emulated else None  # the stage's input shape
        # Only this rank's stage is used: the other layers' weights need not stay in memory.
        layers = [m if a <= i < b else nn.Identity() for i, m in enumerate(full)]
        del full
        if not self.compute.emulated:  # run_peer puts an emulated stage between Contiguous modules itself
            layers[a] = nn.Sequential(Contiguous(), layers[a])
            layers[b - 1] = nn.Sequential(layers[b - 1], Contiguous())
        tx0 = self.tx_bytes() if self.iface else 0
        res = run_peer(layers, self.balance, self.loss, lambda _i: ((self.x,), self.y),
                       microbatches=self.args.microbatches, warmup=self.args.warmup, steps=self.args.iters,
                       lr=LR, momentum=MOMENTUM, comm=self.comm, compute=self.compute, example=example)
        ran = self.args.warmup + self.args.iters  # run_peer's warm-up is inside the traffic window
        tx = (self.tx_bytes() - tx0) * self.args.iters / ran if self.iface else None
        return dict(steps=res["steps"], t_iter=res["t_iter_s"], tx=tx, mem=memory_mb(),
                    engine=res["activation_bytes_per_step"] / self.P * self.args.iters, updates_per_step=1)

    def run(self, name: str) -> dict:
        """One round of one contender, built and destroyed here: its timed steps, traffic and memory."""
        from runtime.emulate import active

        before = dict(active().seconds) if active() else {}
        self.ran = self.args.warmup + self.args.iters  # steps this contender runs (timed() may add one)
        out = getattr(self, kind(name).replace("-", "_"))(name)
        # The accelerator is the process's, shared by the contenders: the kinds of work this one emulated.
        out["parts"] = sorted(k for k, v in active().seconds.items() if v > before.get(k, 0.0)) if active() else []
        if active():  # the busiest rank's modelled device seconds a step (warm-up and timed steps alike)
            out["device_s"] = self.spread(sum(active().seconds.values()) - sum(before.values()))[1] / self.ran
        gc.collect()
        if "t_iter" not in out:  # the round's T_iter: its mean step, so an uneven step weighs as long as it took
            out.update(steps=len(out["secs"]), t_iter=statistics.fmean(out["secs"]))
        out["engine_mean"], out["engine_max"] = self.spread(out["engine"] / self.args.iters)
        if out["tx"] is not None:
            out["tx_mean"], out["tx_max"] = self.spread(out["tx"] / self.args.iters)
        out["rss_mb"], out["hwm_mb"] = (self.spread(v)[1] for v in out["mem"])
        for key in ("weight_copy_bytes", "parameter_bytes"):
            if key in out:
                out[key] = self.spread(out[key])[1]
        return out


def row(args, runner, name: str, rounds: list[dict]) -> dict:
    # A rate is the batch over a step's time, never a mean of per-step rates (that would let a short step of an
    # uneven schedule count for more than the time it took): the median round's T_iter, its CI across rounds.
    t_iter = summary([r["t_iter"] for r in rounds])
    fast, slow = t_iter["ci"]
    rate, rate_ci = args.batch_size / t_iter["median"], [args.batch_size / slow, args.batch_size / fast]
    measured = "tx_mean" in rounds[0]
    how = f"tx_bytes of {runner.iface}" if measured else ("engine count" if kind(name) == "pipeline" else "computed")
    key = "tx" if measured else "engine"
    avg = lambda k: statistics.fmean(r[k] for r in rounds)  # noqa: E731
    most = lambda k: max((r[k] for r in rounds if k in r), default=None)  # noqa: E731
    out = dict(model=args.model, contender=name, kind=kind(name), bandwidth=args.bandwidth, device=args.device,
               ranks=runner.P,
               batch=args.batch_size, microbatches=None if kind(name) == "data-parallel" else args.microbatches,
               samples_per_s=rate, ci=max(rate_ci[1] - rate, rate - rate_ci[0]), samples_per_s_ci=rate_ci,
               ci_coverage=t_iter["coverage"], rounds=len(rounds), steps=sum(r["steps"] for r in rounds),
               t_iter_s=t_iter["median"], t_iter_ci=t_iter["ci"], t_iter_rounds_s=[r["t_iter"] for r in rounds],
               bytes_per_step=avg(f"{key}_mean"), bytes_per_step_max=avg(f"{key}_max"), bytes_measured=how,
               engine_bytes_per_step=avg("engine_mean") if kind(name) == "pipeline" else None,
               weight_copy_bytes=most("weight_copy_bytes"), parameter_bytes=most("parameter_bytes"),
               rss_mb=max(r["rss_mb"] for r in rounds), hwm_mb=max(r["hwm_mb"] for r in rounds),
               updates_per_step=rounds[0]["updates_per_step"],
               balance=runner.balance if kind(name) != "data-parallel" else None, cores=os.cpu_count(),
               **runner.compute.describe())
    if kind(name) == "pipeline":  # per stage: how long each send and op held its host (jobs.bench.pipeline_sends)
        out.update(host_times(runner.comm, rounds))
    if runner.compute.emulated:
        out["emulated_parts"] = sorted({k for r in rounds for k in r["parts"]})
        out["modelled_device_s_max"] = statistics.median(r["device_s"] for r in rounds)
    if kind(name) == "peer" and not measured:
        out["bytes_per_step_max"] = None  # the peer counts all ranks together
    return out


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    t_start = time.perf_counter()
    runner = Runner(args)
    if runner.rank == 0:
        print(f"# {runner.compute.label}", flush=True)
    gloo = any(c in ("ddp", "torch-1f1b") for c in args.contenders)
    if gloo:
        from mpicomm.torchdist import init_gloo

        init_gloo(runner.comm)
    results: dict[str, list] = {c: [] for c in args.contenders}
    for r in range(args.rounds):
        shift = r % len(args.contenders)
        for name in args.contenders[shift:] + args.contenders[:shift]:
            results[name].append(runner.run(name))
            if runner.rank == 0:
                t = results[name][-1]["t_iter"]
                print(f"# {time.perf_counter() - t_start:.1f} s: round {r + 1}/{args.rounds} {name}: "
                      f"{args.batch_size / t:.1f} samples/s (T_iter {t:.3f} s)", flush=True)
    for name in args.contenders:
        out = row(args, runner, name, results[name])
        if runner.rank == 0:
            print_row(out)
    if gloo:
        from mpicomm.torchdist import shutdown_gloo

        shutdown_gloo(runner.comm)
    if runner.timeline is not None:
        write_timeline(runner.comm, args.timeline, runner.timeline, say=print if runner.rank == 0 else lambda *a: None)
    runner.topo.free()
    return 0


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before torch and MPI start
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
