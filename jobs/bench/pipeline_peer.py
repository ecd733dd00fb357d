"""The pipeline benchmark's peer: torch.distributed.pipelining (1F1B or GPipe) over gloo, one stage per rank.

--compute emulated:DEVICE: each rank's stage module is emulated alone at its input's shape (runtime.emulate)
before torch's PipelineStage takes it, the loss is runtime.emulate.emulated_loss and the optimizer emulated.
"""

from __future__ import annotations

import statistics
import sys
import time

from jobs.common.choices import MODELS
from jobs.common.cluster_sweep import print_row
from jobs.common.compute import Compute, add_compute_arguments, check_compute
from jobs.common.inputs import InputError, JobParser, at_least, comma_list, launched_ranks, one_of, output_file, parse

SCHEDULES = ("1f1b", "gpipe")
# Layers of each model flattened for the pipeline (see model_layers): mlp's net on its default
# hidden=256; vgg19's 37 feature layers and 6 classifier layers. tests/test_pipeline_peer_mpi.py checks them.
LAYERS = {"mlp": 4, "vgg19": 43}


def even_balance(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage, as even as the layer count allows; the later stages take the remainder."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (i >= n_stages - extra) for i in range(n_stages)]


def model_layers(model) -> list:
    """The model as a flat list of layers whose composition is its forward (runtime.pipeline.as_layers)."""
    from runtime.pipeline import as_layers

    return as_layers(model)


def Contiguous():  # noqa: N802 (a class, made on first use: torch is imported late)
    """Identity whose output and gradient are contiguous: torch's pipelining allocates a stage's receive
    buffers with the sender's strides, and gloo refuses non-contiguous ones (the char-LSTM's layers
    return transposed views, and so do their input gradients; an emulated stage's are zero-stride)."""
    import torch

    class Grad(torch.autograd.Function):
        forward = staticmethod(lambda ctx, x: x.view_as(x))
        backward = staticmethod(lambda ctx, g: g.contiguous())

    class Contiguous(torch.nn.Module):
        def forward(self, x):
            x = x.contiguous()
            return Grad.apply(x) if x.requires_grad else x
    return Contiguous()


def run_peer(layers, balance: list[int], loss_fn, make_batch, *, microbatches: int, schedule: str = "1f1b",
             warmup: int = 2, steps: int = 10, lr: float = 0.01, momentum: float = 0.9, comm=None,
             compute: Compute | None = None, example=None) -> dict:
    """Train `layers` split by `balance` with torch's own pipeline schedule, one stage per rank of `comm`; time it.

    Collective over `comm` (rank i holds stage i). Every rank passes the same layers (the whole
    model, built with the same seed) and the same make_batch(step) -> (inputs, target), the global
    batch of a step; stage 0 uses the inputs (a tensor or a tuple), the last stage the target.
    Runs warmup + steps SGD steps and trains this rank's slice layers[a:b] in place, so the caller
    can read its parameters afterwards. Starts torch.distributed over gloo on `comm` unless it
    is started already (then its ranks must be comm's), and shuts down only what it started.

    Loss semantics: torch applies loss_fn to each micro-batch and back-propagates each micro-batch
    loss unscaled; with scale_grads=True (the default of Schedule1F1B and ScheduleGPipe, kept
    here) the stage divides its gradients by n_microbatches after the last backward
    (_PipelineStageBase.perform_reduce_grad -> scale_grads). With a mean-reduced loss and equal
    micro-batches, the gradient is the mean over the global batch: one process's full-batch step.

    compute: emulated compute (jobs.common.compute.Compute): this rank's stage emulated alone, traced at
    `example` (its input: a tensor of the true shape and dtype, the meta device will do) or, by default, at
    what layers[:a] make of one micro-batch; between Contiguous modules, so that the true bytes cross; the
    loss emulated_loss, the optimizer emulated. The timed steps then measure torch's schedule and gloo.

    Returns samples_per_s (the batch over the mean timed step, the slowest rank's), ci
    (1.96 stdev / sqrt(n) of the steps, as a rate), t_iter_s, microbatches, stages, balance, batch (global, per step),
    schedule, loss (mean micro-batch loss of the last step, from the last stage, on every rank),
    and activation_bytes_per_step (sent between stages, forward and backward, all ranks together).
    """
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from mpicomm.torchdist import init_gloo, shutdown_gloo

    comm = comm or MPI.COMM_WORLD
    layers, balance = list(layers), list(balance)
    rank, n = comm.Get_rank(), comm.Get_size()
    # The same checks on every rank with the same arguments: all raise together, before any communication.
    if len(balance) != n:
        raise ValueError(f"balance has {len(balance)} stages but comm has {n} ranks (one stage per rank)")
    if min(balance) < 1 or sum(balance) != len(layers):
        raise ValueError(f"balance {balance} must give each stage >= 1 layer and sum to the {len(layers)} layers")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} (choose from {', '.join(SCHEDULES)})")
    if microbatches < 1 or (schedule == "1f1b" and microbatches < n):
        raise ValueError(f"{schedule} needs microbatches >= {n if schedule == '1f1b' else 1}, got {microbatches}")
    if warmup < 0 or steps < 1:
        raise ValueError(f"needs warmup >= 0 and steps >= 1, got {warmup} and {steps}")
    inputs, target = make_batch(0)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    batch = inputs[0].shape[0]
    if batch % microbatches:
        raise ValueError(f"microbatches {microbatches} must divide the global batch {batch}")

    started = not dist.is_initialized()
    if started:
        init_gloo(comm)
    elif (dist.get_rank(), dist.get_world_size()) != (rank, n):
        raise RuntimeError("torch.distributed is started on other ranks than comm's")
    first, last = rank == 0, rank == n - 1
    a = sum(balance[:rank])
    stage_module = nn.Sequential(*layers[a:a + balance[rank]])
    if compute is not None and compute.emulated:
        from runtime.pipeline.emulation import stage_input

        x0 = example if example is not None else stage_input(layers, a, inputs[0][:batch // microbatches])
        stage_module = nn.Sequential(Contiguous(), compute.model(stage_module, (x0,)), Contiguous())
        loss_fn = compute.loss(loss_fn)
    sent = [0]  # bytes of this stage's output for one micro-batch (what goes forward, and its gradient back)
    hook = stage_module.register_forward_hook(
        lambda _m, _i, out: sent.__setitem__(0, out.numel() * out.element_size()))
    stage = PipelineStage(stage_module, stage_index=rank, num_stages=n, device=torch.device("cpu"))
    kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    pipe = kind(stage, n_microbatches=microbatches, loss_fn=loss_fn)  # scale_grads=True: see the docstring
    params = [p for p in stage_module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum) if params else None  # a stage may have none (Flatten)
    if opt is not None and compute is not None:
        opt = compute.optimizer(opt)

    losses: list = []

    def step(x: tuple, y) -> None:
        if opt is not None:
            opt.zero_grad()
        losses.clear()
        if first and last:
            pipe.step(*x, target=y, losses=losses)
        elif first:
            pipe.step(*x)
        elif last:
            pipe.step(target=y, losses=losses)
        else:
            pipe.step()
        if opt is not None:
            opt.step()

    def slowest(seconds: float) -> float:
        t = np.array([seconds])
        comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
        return float(t[0])

    # No try/finally: a rank that raised alone must not wait in shutdown_gloo's barrier; run_main aborts the job.
    per_step = []
    for i in range(warmup + steps):
        x, y = (inputs, target) if i == 0 else make_batch(i)
        x = x if isinstance(x, tuple) else (x,)
        comm.Barrier()
        t0 = time.perf_counter()
        step(x, y)
        elapsed = time.perf_counter() - t0
        if i == 0:
            hook.remove()
        if i >= warmup:
            per_step.append(slowest(elapsed))
    loss = comm.bcast(statistics.fmean(float(v.detach()) for v in losses) if last else None, root=n - 1)
    bytes_per_step = comm.allreduce(0 if last else sent[0] * microbatches * 2)
    if started:
        shutdown_gloo(comm)
    # The batch over the mean step, not a mean of per-step rates; its CI from the steps' spread (first order).
    t_iter = statistics.fmean(per_step)
    t_ci = 1.96 * statistics.stdev(per_step) / len(per_step) ** 0.5 if len(per_step) > 1 else 0.0
    return dict(peer="torch.distributed.pipelining", schedule=schedule, stages=n, balance=balance,
                microbatches=microbatches, batch=batch, samples_per_s=batch / t_iter, ci=batch * t_ci / t_iter ** 2,
                t_iter_s=t_iter, steps=steps, loss=loss,
                activation_bytes_per_step=bytes_per_step)


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.pipeline_peer", description=__doc__)
    p.add_argument("--model", default="mlp", help="mlp or vgg19")
    p.add_argument("--balance", help="layers per stage, e.g. 2,2,2,3 (default: even split by layer count)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="global batch per step")
    p.add_argument("--schedule", default="1f1b", help="1f1b or gpipe")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the row here too")
    add_compute_arguments(p)
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    if args.model not in LAYERS:
        if args.model in MODELS:
            raise InputError("--model", f"{args.model} is not a plain sequence of layers (choose from mlp, vgg19)")
        one_of("--model", args.model, LAYERS)
    one_of("--schedule", args.schedule, SCHEDULES)
    at_least(args, 1, "microbatches", "batch_size", "steps")
    at_least(args, 0, "warmup", "momentum", "seed")
    if not args.lr > 0:
        raise InputError("--lr", f"must be > 0, got {args.lr}")
    ranks, n_layers = launched_ranks(), LAYERS[args.model]
    if args.balance is None:
        if n_layers < ranks:
            raise InputError("--model", f"{args.model} has {n_layers} layers, fewer than the {ranks} ranks "
                                        "(one stage of at least one layer per rank)")
        args.balance = even_balance(n_layers, ranks)
    else:
        args.balance = comma_list("--balance", args.balance, parse=int)
        if len(args.balance) != ranks:
            raise InputError("--balance", f"{len(args.balance)} stages but the job runs on {ranks} ranks "
                                          "(one stage per rank)")
        if min(args.balance) < 1 or sum(args.balance) != n_layers:
            raise InputError("--balance", f"each stage needs >= 1 layer and the sum must be {args.model}'s "
                                          f"{n_layers} layers, got {','.join(map(str, args.balance))}")
    if args.batch_size % args.microbatches:
        raise InputError("--microbatches", f"must divide --batch-size {args.batch_size}, got {args.microbatches}")
    if args.schedule == "1f1b" and args.microbatches < ranks:
        raise InputError("--microbatches", f"1f1b needs at least one per stage ({ranks}), got {args.microbatches}")
    output_file(args, "json")
    check_compute(args)


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    import torch
    from mpi4py import MPI

    from jobs.common.outputs import write_together
    from jobs.common.report import write_json
    from runtime.workloads.models import build_model, loss_fn, model_input

    torch.set_num_threads(1)  # several ranks share the cores, as in jobs.bench.strategies_worker
    comm = MPI.COMM_WORLD
    if comm.Get_size() != len(args.balance):  # a launcher launched_ranks() did not read: same on every rank
        if comm.Get_rank() == 0:
            print(f"error: --balance: {len(args.balance)} stages but the job runs on {comm.Get_size()} ranks "
                  "(one stage per rank)", file=sys.stderr, flush=True)
        return 2
    torch.manual_seed(args.seed)
    layers = model_layers(build_model(args.model))
    (x,), y = model_input(args.model, args.batch_size, args.seed)
    compute = Compute.from_args(args)
    row = run_peer(layers, args.balance, loss_fn(args.model), lambda _step: (x, y),
                   microbatches=args.microbatches, schedule=args.schedule, warmup=args.warmup, steps=args.steps,
                   lr=args.lr, momentum=args.momentum, comm=comm, compute=compute)
    row = dict(model=args.model, **row, **compute.describe())
    if comm.Get_rank() == 0:
        print_row(row)
    if args.json:
        write_together(comm, "--json", args.json, lambda: write_json(args.json, dict(job="pipeline_peer"), [row]),
                       here=comm.Get_rank() == 0)
    return 0


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2 on every rank, before torch starts
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
