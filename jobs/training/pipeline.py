"""jobs.train --parallel pipeline: the model cut into stages across ranks (runtime.pipeline), data parallel's outputs."""

from __future__ import annotations

import os
import sys
import time

from jobs.common.choices import PIPELINE_MODES, SEQUENTIAL_MODELS

# The pipeline's options and their defaults: given without --parallel pipeline, they are an error.
# --spectrain-variant defaults to None so that it is seen given: it applies to --pipeline-mode spectrain only.
PIPELINE_DEFAULTS = dict(pipeline_mode="flush", spectrain_variant=None, stages=None, replicas=1, balance=None,
                         microbatches=4, placement="within-node")


def add_arguments(p) -> None:
    g = p.add_argument_group("pipeline (--parallel pipeline)")
    g.add_argument("--parallel", choices=("data", "pipeline"), default="data",
                   help="data: every rank holds the model (--strategy); pipeline: the model is cut into --stages")
    g.add_argument("--pipeline-mode", choices=PIPELINE_MODES, default=PIPELINE_DEFAULTS["pipeline_mode"],
                   help="flush (synchronous: one update per step at --lr), or vanilla, stash (PipeDream), "
                        "spectrain (asynchronous: one update per micro-batch at --lr / --microbatches); "
                        "default flush")
    g.add_argument("--spectrain-variant", choices=("paper", "once"),
                   help="--pipeline-mode spectrain: the paper's weight prediction, or once (the forward's kept "
                        "for the backward); default paper")
    g.add_argument("--stages", type=int, help="pipeline stages (default: ranks / --replicas)")
    g.add_argument("--replicas", type=int, default=PIPELINE_DEFAULTS["replicas"],
                   help="copies of each stage, averaging gradients (default 1)")
    g.add_argument("--balance", help="layers per stage, e.g. 3,2,2,1 (default: measured automatic partition)")
    g.add_argument("--microbatches", type=int, default=PIPELINE_DEFAULTS["microbatches"],
                   help="micro-batches per step (default 4)")
    g.add_argument("--placement", choices=("within-node", "across-nodes"), default=PIPELINE_DEFAULTS["placement"])


def check_arguments(args, launched: int) -> None:
    """What can be known wrong before MPI starts (launched: ranks mpiexec started, 0 if unknown)."""
    from jobs.common.inputs import InputError, at_least

    if args.parallel == "data":
        for name, default in PIPELINE_DEFAULTS.items():
            if getattr(args, name) != default:
                raise InputError("--" + name.replace("_", "-"), "needs --parallel pipeline")
        return
    if args.model not in SEQUENTIAL_MODELS:
        raise InputError("--model", f"{args.model} is not sequential; a pipeline takes {', '.join(SEQUENTIAL_MODELS)}")
    if args.spectrain_variant is not None and args.pipeline_mode != "spectrain":
        raise InputError("--spectrain-variant", "needs --pipeline-mode spectrain")
    if args.pipeline_mode == "spectrain" and args.spectrain_variant is None:
        args.spectrain_variant = "paper"
    if args.pipeline_mode == "spectrain" and (args.optimizer != "sgd" or args.momentum == 0):  # else every stage's
        # optimizer is refused once the pipeline is being built
        raise InputError("--optimizer" if args.optimizer != "sgd" else "--momentum",
                         "spectrain predicts weights from SGD's momentum: needs --optimizer sgd, --momentum > 0")
    # The strategy is only how a stage's replicas average their gradients (runtime.pipeline.stage_optimizer):
    # p3 (once quietly run as allreduce) and the others are refused, and so is a strategy with no replicas.
    if args.strategy is not None:
        if args.strategy not in ("allreduce", "wfbp"):
            raise InputError("--strategy", "with --parallel pipeline, replicas average gradients with allreduce or "
                                           "wfbp")
        if args.replicas == 1:
            raise InputError("--strategy", "with --parallel pipeline, it is how --replicas average gradients: "
                                           "needs --replicas 2 or more")
    else:
        args.strategy = "allreduce"
    if args.pto or args.cache_dir:
        raise InputError("--pto" if args.pto else "--cache-dir", "is not available with --parallel pipeline")
    at_least(args, 1, "replicas", "microbatches", "stages")
    if args.balance:
        parts = [b.strip() for b in args.balance.split(",")]
        if not all(b.isdigit() and int(b) > 0 for b in parts):
            raise InputError("--balance", "must be positive layer counts, e.g. 3,2,2,1")
        args.balance = [int(b) for b in parts]
        if args.stages and args.stages != len(args.balance):
            raise InputError("--balance", f"has {len(args.balance)} stages, --stages says {args.stages}")
    if args.batch_size % args.microbatches:
        raise InputError("--microbatches", f"{args.microbatches} does not divide --batch-size {args.batch_size}")
    if launched:
        stages = args.stages or (len(args.balance) if args.balance else launched // args.replicas)
        if stages < 1 or stages * args.replicas != launched:
            raise InputError("--stages" if args.stages else "--replicas",
                             f"{launched} ranks cannot run {stages} stages x {args.replicas} replicas")


def run(args, data, topo) -> int:
    """jobs.train's loop for --parallel pipeline; data = (x, y, test x, test y), tuples of tensors; exit status."""
    import numpy as np
    import torch
    from mpi4py import MPI

    from jobs.common.outputs import write_training_outputs
    from jobs.common.progress import epoch_progress
    from runtime.pipeline import DivergenceError, Pipeline, PipelineError
    from runtime.workloads.data import BatchPlan
    from runtime.workloads.models import build_model, loss_fn

    x, y, tx, ty = data
    comm, rank, P = topo.world, topo.rank, topo.size
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    model = build_model(args.model, **({"num_classes": 10} if args.model != "char-lstm" else {}))
    stages = len(args.balance) if args.balance else (args.stages or P // args.replicas)
    micro = args.batch_size // args.microbatches
    if args.optimizer == "adam":
        def factory(ps): return torch.optim.Adam(ps, lr=args.lr)
    else:
        def factory(ps): return torch.optim.SGD(ps, lr=args.lr, momentum=args.momentum)
    timeline = None
    if args.timeline:
        from runtime.trace import Timeline
        timeline = Timeline(rank)
    try:
        # spectrain_variant: None outside spectrain (check_arguments), where it means nothing; Pipeline takes a name.
        pipe = Pipeline(model, factory, loss_fn=loss_fn(args.model), balance=args.balance,
                        stages=None if args.balance else stages, sample=x[0][:micro], microbatches=args.microbatches,
                        mode=args.pipeline_mode, spectrain_variant=args.spectrain_variant or "paper",
                        replicas=args.replicas, placement=args.placement, data_parallel=args.strategy,
                        topology=topo, timeline=timeline, say=say, device=args.device)
    except PipelineError as exc:  # raised on every rank together (a --balance that does not cover the model, ...):
        # one line, not a traceback from each rank; the half-built pipeline has released what it held.
        option = "--balance" if args.balance else "--stages" if args.stages else "--parallel"
        say(f"error: {option}: {said_once(exc, P)}", file=sys.stderr, flush=True)
        return 2
    start_epoch = resume(args, pipe, comm, say) if args.resume else 0
    if start_epoch is None:  # said; every rank stops here
        pipe.close()
        return 2
    replica, R = pipe.replica, pipe.replicas
    plan = BatchPlan(len(x[0]), args.batch_size, R, replica, args.seed)
    steps = min(len(plan), args.max_steps) if args.max_steps else len(plan)
    shows = pipe.last and replica == 0  # the rank that has the loss shows progress
    say(f"{args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params), {args.data}, pipeline "
        f"{args.pipeline_mode}: {stages} stages {pipe.balance} x {R} replicas, {args.microbatches} micro-batches "
        f"of {micro}, {steps} steps/epoch, on {args.device}", flush=True)
    history = []
    for epoch in range(start_epoch, args.epochs):
        bar = epoch_progress(steps, f"epoch {epoch + 1}/{args.epochs}", args.batch_size * R) \
            if shows and not args.no_progress else None
        comm.Barrier()
        t0 = time.perf_counter()
        loss_sum = 0.0
        try:
            for idx in plan.epoch(epoch)[:steps]:
                idx = torch.as_tensor(idx)
                loss = pipe.train_step(x[0][idx] if pipe.first else None, y[idx] if pipe.last else None)
                if loss is not None:
                    loss_sum += loss
                    if bar is not None:
                        bar.update(loss)
            pipe.drain()  # the epoch's weights are complete before they are scored and saved
            pipe.barrier()  # not comm.Barrier(): a stage that never waits for the last one hears of its failure here
        except DivergenceError as exc:  # raised on every rank: each says so, and the job stops
            if bar is not None:
                bar.close()
            # One write per line: ranks share stderr, and print() writes the newline apart.
            sys.stderr.write(f"error: rank {rank}: {exc} (epoch {epoch + 1}; --lr {args.lr:g})\n")
            sys.stderr.flush()
            return 3
        elapsed = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        # Loss: mean over the last stages' steps; accuracy: each replica scores 1/R of the test set.
        share = np.array_split(np.arange(len(tx[0])), R)[replica]
        scores = pipe.evaluate(tx[0][share] if pipe.first else None, ty[share] if pipe.last else None)
        sums = np.array([loss_sum / max(1, steps) if pipe.last else 0.0,
                         scores["accuracy"] * scores["count"] if pipe.first else 0.0,
                         scores["count"] if pipe.first else 0.0])
        comm.Allreduce(MPI.IN_PLACE, sums)
        stats = pipe.stats()
        sent = np.array([stats["bytes_sent"]], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, sent)
        row = dict(epoch=epoch + 1, loss=float(sums[0] / R), test_accuracy=float(sums[1] / max(1, sums[2])),
                   samples_per_s=steps * args.batch_size * R / elapsed, seconds=elapsed,
                   stage_bytes_sent=int(sent[0]))
        history.append(row)
        say(f"epoch {epoch + 1}: loss {row['loss']:.4f}  test accuracy {row['test_accuracy'] * 100:.2f} %  "
            f"{row['samples_per_s']:.0f} samples/s  ({elapsed:.1f} s)", flush=True)
        if args.checkpoint:
            save(args, pipe, comm, epoch)
    pipe.close()
    write_training_outputs(comm, args, timeline, dict(args=vars(args), ranks=P, parallel="pipeline",
                                                      balance=pipe.balance, epochs=history), say)
    topo.free()  # not after a failure: the pipeline keeps its communicators then (runtime.pipeline.engine)
    return 0


def said_once(exc, ranks: int) -> str:
    """fail_together's message, without its rank list where every rank had the same problem."""
    every = f"rank {', '.join(map(str, range(ranks)))}: "
    return str(exc).removeprefix(every)


def stage_file(path: str, stage: int, stages: int) -> str:
    return f"{path}.stage{stage}-of-{stages}"


def save(args, pipe, comm, epoch: int) -> None:
    """Each stage's first replica writes its stage (atomically: temp file, then rename)."""
    import torch

    from jobs.common.outputs import write_together

    path = stage_file(args.checkpoint, pipe.stage, pipe.stages)

    def write():
        tmp = path + ".tmp"
        torch.save(dict(epoch=epoch, stage=pipe.state_dict(), args=vars(args)), tmp)
        os.replace(tmp, path)
    write_together(comm, "--checkpoint", path, write, here=pipe.layout.replica == 0)


def resume(args, pipe, comm, say) -> int | None:
    """The epoch to start from: every stage's file read if all exist (replicas read their stage's), else 0;
    None on every rank together after rank 0 said why in one line."""
    import numpy as np
    import torch

    from jobs.training.resume import nothing_left
    from mpicomm.agree import fail_together

    path = stage_file(args.checkpoint, pipe.stage, pipe.stages)
    have = np.array([os.path.exists(path)], dtype=np.int8)
    everyone = np.empty(comm.Get_size(), dtype=np.int8)
    comm.Allgather(have, everyone)
    if not everyone.any():
        say(f"no checkpoint at {args.checkpoint}.stage*: starting from scratch")
        return 0
    problem, epoch = None, 0
    try:
        if not have[0]:
            raise FileNotFoundError(f"{path} is missing (other stages have theirs)")
        saved = torch.load(path, weights_only=False, map_location="cpu")  # load_state_dict moves it to the stage
        pipe.load_state_dict(saved["stage"])
        epoch = int(saved["epoch"]) + 1
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        problem = str(exc)
    try:
        fail_together(comm, problem, ValueError)
    except ValueError as exc:
        say(f"error: --resume: {said_once(exc, comm.Get_size())}", file=sys.stderr, flush=True)
        return None
    epochs = comm.allgather(epoch)
    if len(set(epochs)) > 1:  # every rank sees the same list
        say(f"error: --resume: stage checkpoints of different epochs: {epochs}", file=sys.stderr, flush=True)
        return None
    say(f"resumed from {args.checkpoint}.stage* after epoch {epoch}")
    nothing_left(args, epoch, say)
    return epoch
