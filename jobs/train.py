"""Data-parallel training over MPI with a chosen gradient-synchronisation strategy — the main job.

    mpiexec -n 4 mpitrain train                                  # MLP, Fashion-MNIST, p3, 2 epochs
    mpiexec -n 4 mpitrain train --model vgg19 --data synthetic --strategy wfbp --max-steps 20
    mpiexec -n 4 mpitrain train --checkpoint ckpt.pt --resume --timeline trace.json
    mpiexec -n 4 mpitrain train --strategy hier-topk --density 0.01 --pto
    mpiexec -n 4 mpitrain train --model vgg19-22k --data synthetic --strategy hybcomm --link-bandwidth 1gbit
    mpiexec -n 4 mpitrain train --cache-dir /tmp/mpitrain-cache   # training data through datacache
    mpiexec -n 4 mpitrain train --parallel pipeline --pipeline-mode spectrain --microbatches 8
    mpiexec -n 4 mpitrain train --device cuda --model resnet50 --data synthetic --strategy wfbp

Every rank reads its share of each global batch (--batch-size per rank), so
the run equals single-process SGD on batches of batch-size x ranks. Rank 0
shows progress and prints per-epoch loss, test accuracy and samples/s.
With --device cuda each rank trains on GPU local_rank % GPUs (ranks may
share one); batches reach it through pinned buffers, non-blocking.
With --compute emulated:DEVICE (--compute-scale; jobs.common.compute) the
model, loss and optimizer wait the time DEVICE would take instead of
computing (runtime.emulate), and the gradients exchanged have the true sizes
and order: samples/s is the figure, loss and accuracy mean nothing and are
not computed (null in --json; no scoring), and with --data synthetic each
rank holds one batch that every step takes. The epoch lines and --json name
the compute mode.
"""

from __future__ import annotations

import argparse
import sys
import time

from jobs.common.choices import (FIXED_CLASSES, HYBCOMM_DENSE, HYBCOMM_FORCE, MODELS, P3_CREDIT_WORDS,
                                 SPARSE_STRATEGIES, STRATEGIES, TOKEN_MODELS)
from jobs.common.inputs import (InputError, JobParser, add_device_argument, at_least, auto_or_count, check_device,
                                existing_dir, fraction, launched_ranks, link_rate, one_of, option, output_dir,
                                output_file, parse)
from jobs.common.compute import Compute, add_compute_arguments, check_compute
from jobs.training import pipeline as train_pipeline
from jobs.training import resume
from jobs.training.data import (batch_plan, evaluate, example_inputs, load_data, open_cache, too_few_samples,
                                train_batches)

# hybcomm's options and the value each takes when not given; given with another strategy, they are an error.
HYBCOMM_DEFAULTS = dict(hybcomm_dense="wfbp", hybcomm_force="auto", link_bandwidth=None)
# Likewise (check_applicable) the sparse strategies', p3's (hybcomm's dense p3 too), the cache's and SGD's:
# a run never drops an option it was given. Where one does not apply it stays None (so in --json's args).
TOPK_DEFAULTS = dict(density=0.01, no_error_feedback=False, dense_warmup_steps=0, density_ramp_steps=0,
                     topk_granularity="model", topk_operator="mstopk")
P3_DEFAULTS = dict(slice_size="auto", credit="auto")
CACHE_DEFAULTS = dict(prefetch=4, cache_memory_mb=256)
SGD_DEFAULTS = dict(momentum=0.9)


def parse_args(argv=None):
    """The checked command line; a bad value prints one `error:` line and exits 2 on every rank."""
    p = JobParser(prog="python -m jobs.train", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", choices=MODELS, default="mlp")
    p.add_argument("--data", choices=("fashion-mnist", "synthetic", "austen"), default="fashion-mnist",
                   help="austen: Jane Austen's novels, characters (char-lstm; validation = the last 10 %%)")
    # Options that apply to some runs only default to None here: check_args refuses them where they do not apply
    # and sets the defaults the help names where they do (*_DEFAULTS).
    p.add_argument("--strategy",
                   help="allreduce, wfbp, p3, hybcomm (exact) or topk, hier-topk (sparsified; default p3; "
                        "--parallel pipeline: allreduce or wfbp, with --replicas 2 or more, default allreduce)")
    p.add_argument("--density", type=float, help="topk/hier-topk: fraction sent (default 0.01)")
    p.add_argument("--no-error-feedback", action="store_true", default=None,
                   help="topk/hier-topk: drop what is not sent")
    p.add_argument("--dense-warmup-steps", type=int, help="topk/hier-topk: dense steps first (default 0)")
    p.add_argument("--density-ramp-steps", type=int,
                   help="topk/hier-topk: steps over which density falls from 0.25 to --density (DGC-style; "
                        "default 0)")
    p.add_argument("--topk-granularity", choices=("model", "layer"),
                   help="topk/hier-topk: select top-k over the flattened model or per layer (default model)")
    p.add_argument("--topk-operator", choices=("mstopk", "exact"),
                   help="topk/hier-topk: approximate MSTopK or exact torch.topk (default mstopk)")
    p.add_argument("--hybcomm-dense", choices=HYBCOMM_DENSE,
                   help="hybcomm: the path of the gradients not sent as sufficient factors (default wfbp)")
    p.add_argument("--hybcomm-force", choices=HYBCOMM_FORCE,
                   help="hybcomm: auto (the cost model picks per layer), or sfb/ps for every eligible layer "
                        "(default auto)")
    p.add_argument("--link-bandwidth", metavar="RATE",
                   help="hybcomm: a node's link for the cost model, e.g. 1gbit (default $MPITRAIN_LINK_BANDWIDTH "
                        "or 10gbit)")
    p.add_argument("--pto", action="store_true",
                   help="each rank updates 1/P of the parameters, then allgather (optimizer state sharded)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="default sgd (with --momentum)")
    p.add_argument("--slice-size",
                   help="p3 (and hybcomm's dense p3) slice, in elements, or auto: chosen from the link measured at "
                        "start-up (default auto)")
    p.add_argument("--credit",
                   help="p3 (and hybcomm's dense p3): outgoing slices in flight, auto: from the measured link, or "
                        "online: auto's first, then the fastest of a few tried over the first ~30 steps (default auto)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step (default 64)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate of a step (default 0.05; asynchronous "
                                                          "pipeline modes: lr / --microbatches per micro-batch)")
    p.add_argument("--momentum", type=float, help="--optimizer sgd's (default 0.9)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--synthetic-samples", type=int, default=4096, help="size of the synthetic training set")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    add_device_argument(p)
    p.add_argument("--cache-dir", help="read training samples through datacache (node-local HDF5 + memory)")
    p.add_argument("--data-dir", help="with --cache-dir: the training source (image folder, labels.csv folder "
                                      "or IDX dir; default Fashion-MNIST's IDX train split)")
    p.add_argument("--cache-memory-mb", type=int,
                   help="with --cache-dir: in-memory cache level per rank (default 256)")
    p.add_argument("--prefetch", type=int, help="with --cache-dir: batches read ahead (default 4)")
    p.add_argument("--checkpoint", metavar="PATH", help="save model+optimizer after every epoch (atomically)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint; if the file does not exist yet, start from scratch and say so "
                        "(a requeued job keeps one command line)")
    p.add_argument("--timeline", metavar="PATH", help="Chrome-trace JSON of the run, one track per rank")
    p.add_argument("--json", metavar="PATH", help="write per-epoch metrics here")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress (else a bar on a terminal, a line every ~10 %% of an epoch in a log file)")
    train_pipeline.add_arguments(p)
    add_compute_arguments(p)
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    """Everything that can be known wrong before MPI starts, from the cheapest check on."""
    if args.strategy is not None:
        one_of("--strategy", args.strategy, STRATEGIES)
    if args.compute != "real" and args.parallel == "pipeline":
        raise InputError("--compute", "emulated compute trains data parallel only for now: drop --parallel pipeline")
    at_least(args, 1, "batch_size", "epochs", "threads", "synthetic_samples", "prefetch")
    auto_or_count(args, "slice_size")
    auto_or_count(args, "credit", words=P3_CREDIT_WORDS)
    at_least(args, 0, "max_steps", "dense_warmup_steps", "density_ramp_steps", "lr", "momentum", "seed",
             "cache_memory_mb")
    fraction(args, "density")
    if args.resume and not args.checkpoint:
        raise InputError("--resume", "needs --checkpoint PATH")
    if args.data == "fashion-mnist" and args.model in TOKEN_MODELS:
        raise InputError("--data", f"{args.model} trains on sequences: use --data synthetic"
                                   + (" or --data austen" if args.model == "char-lstm" else ""))
    if args.data == "fashion-mnist" and args.model in FIXED_CLASSES:
        raise InputError("--data", f"{args.model} has {FIXED_CLASSES[args.model]:,} classes, Fashion-MNIST 10: "
                                   "use --data synthetic")
    if args.data == "austen" and args.model != "char-lstm":
        raise InputError("--data", "austen is a character corpus: use it with --model char-lstm")
    if args.cache_dir and (args.data != "fashion-mnist" or args.model in TOKEN_MODELS):
        raise InputError("--cache-dir", "serves image data: use it with --data fashion-mnist and an image model")
    if args.data_dir and not args.cache_dir:
        raise InputError("--data-dir", "needs --cache-dir")
    launched = launched_ranks()
    train_pipeline.check_arguments(args, launched)  # --parallel pipeline's --strategy, and its default
    if args.data == "synthetic" and (why := too_few_samples(args, args.synthetic_samples, launched)):
        raise InputError("--synthetic-samples", why)
    if args.strategy is None:
        args.strategy = "p3"
    check_hybcomm(args)
    check_applicable(args)
    existing_dir(args, "data_dir")
    output_dir(args, "cache_dir", writable=False)  # an unwritable cache falls back to the source
    output_file(args, "json")
    output_file(args, "checkpoint", "timeline", replaced=True)  # both written to a temp file, then renamed
    check_device(args)  # imports torch when cuda is asked: last
    check_compute(args)  # imports torch when emulating


def check_hybcomm(args) -> None:
    """hybcomm's options: refused with another strategy, else defaulted; --link-bandwidth also as link_bandwidth_bps."""
    if args.strategy != "hybcomm":
        for name in HYBCOMM_DEFAULTS:
            if getattr(args, name) is not None:
                raise InputError(option(name), "needs --strategy hybcomm")
        return
    for name, default in HYBCOMM_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.link_bandwidth_bps = None
    if args.link_bandwidth is not None:  # link_rate imports torch (mpicomm): only paid when the option is given
        args.link_bandwidth_bps = link_rate("--link-bandwidth", args.link_bandwidth)


def check_applicable(args) -> None:
    """The options of one strategy, of the cache or of SGD: refused where they do not apply, else defaulted."""
    pipeline = args.parallel == "pipeline"  # its replicas average with allreduce or wfbp: no strategy's options
    p3 = args.strategy == "p3" or (args.strategy == "hybcomm" and args.hybcomm_dense == "p3")
    for defaults, applies, why in (
            (TOPK_DEFAULTS, args.strategy in SPARSE_STRATEGIES,
             "is not available with --parallel pipeline" if pipeline else "needs --strategy topk or hier-topk"),
            (P3_DEFAULTS, p3, "is not available with --parallel pipeline" if pipeline else
             "needs --strategy p3 (or --strategy hybcomm --hybcomm-dense p3)"),
            (CACHE_DEFAULTS, bool(args.cache_dir), "needs --cache-dir"),
            (SGD_DEFAULTS, args.optimizer == "sgd", "needs --optimizer sgd (adam does not take it)")):
        for name, default in defaults.items():
            if not applies and getattr(args, name) is not None:
                raise InputError(option(name), why)
            if applies and getattr(args, name) is None:
                setattr(args, name, default)


def strategy_options(args):
    """The --strategy and its options as a runtime options object."""
    from runtime import P3Options, TopkOptions
    from runtime.options import HybCommOptions

    if args.strategy == "hybcomm":
        p3 = {name: getattr(args, name) for name in P3_DEFAULTS if getattr(args, name) is not None}  # dense p3's
        return HybCommOptions(dense=args.hybcomm_dense, force=args.hybcomm_force, bandwidth=args.link_bandwidth_bps,
                              **p3)
    if args.strategy == "p3":
        return P3Options(slice_size=args.slice_size, credit=args.credit)
    if args.strategy in ("topk", "hier-topk"):
        return TopkOptions(density=args.density, hierarchical=args.strategy == "hier-topk",
                           error_feedback=not args.no_error_feedback, warmup_steps=args.dense_warmup_steps,
                           ramp_steps=args.density_ramp_steps, granularity=args.topk_granularity,
                           operator=args.topk_operator)
    return args.strategy


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    import numpy as np
    import torch
    from mpi4py import MPI

    from datacache.austen import CorpusFetchError
    from jobs.common.devices import LossValues, describe, header_line, rank_device
    from jobs.common.outputs import write_training_outputs
    from jobs.common.plans import PlanWatch, plan_rows
    from jobs.common.progress import epoch_progress
    from mpicomm import Topology
    from mpicomm.agree import fail_together
    from runtime import CheckpointError, DistributedOptimizer, save_checkpoint
    from runtime.device import DeviceFeed
    from runtime.workloads.models import FIXED_CLASSES as CLASSES
    from runtime.workloads.models import build_model, input_shape, loss_fn

    torch.set_num_threads(args.threads)
    topo = Topology()
    comm, rank, P = topo.world, topo.rank, topo.size
    say = print if rank == 0 else (lambda *a, **k: None)
    cache, problem = None, None
    try:
        x, y, tx, ty = load_data(args, rank)
        if args.cache_dir:
            cache = open_cache(args, rank, P)
        elif args.data != "synthetic" and (why := too_few_samples(args, len(x[0]), P)):
            problem = f"--batch-size: {why}"
    # FileNotFoundError, a broken source, an unusable node-local cache, a corpus apt cannot fetch
    except (OSError, ValueError, CorpusFetchError) as exc:
        problem = str(exc)
    try:
        # Data problems can be local (a node's cache directory): stop every rank, not just this one.
        fail_together(comm, problem)
    except RuntimeError as exc:
        # The same problem on every rank (a dataset too small for one batch) is said alone, as parse() does.
        say(f"error: {train_pipeline.said_once(exc, P)}", file=sys.stderr)
        return 2

    if args.parallel == "pipeline":
        return train_pipeline.run(args, (x, y, tx, ty), topo)  # frees topo when it ends well
    device = rank_device(args.device, topo)
    torch.manual_seed(args.seed)
    classes = CLASSES.get(args.model, 1000 if args.model == "transformer" else 10)  # as the data's (model_input)
    model = build_model(args.model, num_classes=classes,
                        **({"in_channels": 3} if args.model in ("vgg19", "resnet50") else {})).to(device)
    compute = Compute.from_args(args)
    model = compute.model(model, example_inputs(args, x))  # before anything hooks the model
    if args.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = compute.optimizer(opt)
    timeline = None
    if args.timeline:
        from runtime.trace import Timeline, instrument

        timeline = Timeline(rank)
        instrument(model, timeline)
    dopt = DistributedOptimizer(opt, model, strategy_options(args), topology=topo, pto=args.pto, timeline=timeline)
    start_epoch = resume.start_epoch(args, model, dopt, say) if args.resume else 0
    if start_epoch is None:
        dopt.close()
        return 2
    criterion = compute.loss(loss_fn(args.model))
    plan = None if cache else batch_plan(args, x, P, rank)
    full = cache.steps(args.batch_size) if cache else len(plan)
    steps = min(full, args.max_steps) if args.max_steps else full
    shape = input_shape(args.model) if cache else None
    device_info = describe(device, comm, dopt)  # collective
    feed, loss_reader = DeviceFeed(device), LossValues(device)
    say(f"{args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params), {args.data}, "
        f"strategy {args.strategy}{' + pto' if args.pto else ''}, {P} ranks x batch {args.batch_size}, "
        f"{steps} steps/epoch")
    say(header_line(device_info))
    if compute.emulated:
        say(f"{compute.label}: throughput only; loss and accuracy are meaningless under emulation and are not "
            "computed (no scoring)")
    tuning = getattr(dopt.strategy, "tuning", None) or getattr(getattr(dopt.strategy, "inner", None), "tuning", None)
    if tuning is not None:
        say(f"p3: {tuning.describe()}")
    trials = dopt.strategy.trials  # credit="online": its choice is said once made
    history = []
    plan_watch = PlanWatch(dopt.strategy, say) if rank == 0 else None  # hybcomm's plan, whenever it changes
    for epoch in range(start_epoch, args.epochs):
        bar = None
        if rank == 0 and not args.no_progress:
            bar = epoch_progress(steps, f"epoch {epoch + 1}/{args.epochs}"
                                 + (" (emulated: loss not computed)" if compute.emulated else ""), args.batch_size * P)
        comm.Barrier()
        t0 = time.perf_counter()
        loss_sum = 0.0
        waited, fetched = (cache.stats.wait_s, cache.stats.fetch_s) if cache else (0.0, 0.0)
        for step, (inputs, target) in enumerate(train_batches(args, epoch, steps, x, y, plan, cache, shape, feed)):
            dopt.zero_grad()
            loss = criterion(model(*inputs), target)
            loss_value = loss_reader.push(loss)  # on a GPU the previous step's: read without waiting for this one
            loss.backward()
            try:
                dopt.step()
            except FloatingPointError as exc:  # raised on every rank together (NonFiniteGradientError)
                say(f"\nerror: step {step + 1} of epoch {epoch + 1}: {exc}", file=sys.stderr, flush=True)
                return 3
            if plan_watch is not None:
                plan_watch.check()
            if trials is not None and trials.chosen is not None:
                say(f"p3: {trials.describe()}")  # credit="online": its trials are over
                trials = None
            if loss_value is not None:
                loss_sum += loss_value
                if bar is not None:
                    bar.update(None if compute.emulated else loss_value)  # emulation computes no loss: none shown
        loss_value = loss_reader.flush()  # the last step's, on a GPU
        if loss_value is not None:
            loss_sum += loss_value
            if bar is not None:
                bar.update(None if compute.emulated else loss_value)
        dopt.synchronize()
        compute.synchronize(device)  # the epoch's kernels (a GPU's, an emulated one's) are over before it is timed
        comm.Barrier()
        elapsed = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        losses = np.array([loss_sum / max(1, steps)])
        comm.Allreduce(MPI.IN_PLACE, losses)
        acc, scored = (None, 0) if compute.emulated else evaluate(model, tx, ty, comm, feed)
        row = dict(epoch=epoch + 1, loss=None if compute.emulated else float(losses[0] / P), test_accuracy=acc,
                   test_targets=scored, samples_per_s=steps * args.batch_size * P / elapsed, seconds=elapsed)
        if cache:
            # wait: blocked because the next batch was not ready; fetch: all time taking batches
            # (includes handing the GIL back from the read-ahead thread). Slowest rank of each.
            wait = np.array([cache.stats.wait_s - waited, cache.stats.fetch_s - fetched])
            comm.Allreduce(MPI.IN_PLACE, wait, op=MPI.MAX)
            row.update(data_wait_s=float(wait[0]), data_wait_fraction=float(wait[0]) / elapsed,
                       data_fetch_fraction=float(wait[1]) / elapsed, cache_state=cache.state)
        history.append(row)
        scores = f"[{compute.label}]  " if compute.emulated else \
            f"loss {row['loss']:.4f}  test accuracy {acc * 100:.2f} %  "
        say(f"epoch {epoch + 1}: {scores}{row['samples_per_s']:.0f} samples/s  ({elapsed:.1f} s)"
            + (f"  data wait {row['data_wait_fraction'] * 100:.1f} % (fetch {row['data_fetch_fraction'] * 100:.1f} %)"
               if cache else ""), flush=True)
        if args.checkpoint:
            try:
                save_checkpoint(args.checkpoint, model, dopt, epoch=epoch, args=vars(args))  # collective
            except CheckpointError as exc:  # a write failing at run time (disk full): every rank stops
                say(f"error: --checkpoint: {exc}", file=sys.stderr)
                dopt.close()
                return 1
    plan = plan_rows(dopt.strategy)  # None but under hybcomm
    metrics = dict(args=vars(args), ranks=P, device=device_info, **compute.describe(), compute_label=compute.label,
                   epochs=history)
    if plan is not None:
        metrics.update(plan=plan, plan_version=dopt.strategy.plan_version)
    if tuning is not None:  # what p3 chose (and, with --credit online, its trials)
        metrics["p3"] = dict(settings=tuning.describe(), online=dopt.strategy.trials.describe()
                             if dopt.strategy.trials is not None else None)
    dopt.close()
    if cache is not None:
        cache.close()
    write_training_outputs(comm, args, timeline, metrics, say)
    topo.free()
    return 0


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before torch and MPI start
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
