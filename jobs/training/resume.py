"""--resume for data-parallel training: the epoch to start from, said on rank 0 whichever way it goes."""

from __future__ import annotations

import sys


def start_epoch(args, model, dopt, say) -> int | None:
    """The epoch after the checkpoint's; 0 when --checkpoint does not exist yet; None after an error line.

    A missing file is not an error: a job that SLURM requeues keeps one command line, and its first run
    finds nothing to resume. It is said, though, so that a mistyped path does not pass for a resumed run.
    """
    from runtime import CheckpointError, load_checkpoint

    try:
        # Rank 0 reads the file and decides for every rank: node-local checkpoints work.
        extra = load_checkpoint(args.checkpoint, model, dopt)
    except CheckpointError as exc:
        say(f"error: --resume: {exc}", file=sys.stderr)
        return None
    if extra is None:
        say(f"no checkpoint at {args.checkpoint}: starting from scratch", flush=True)
        return 0
    say(f"resumed from {args.checkpoint} after epoch {extra['epoch'] + 1}", flush=True)
    nothing_left(args, extra["epoch"] + 1, say)
    return extra["epoch"] + 1


def nothing_left(args, done: int, say) -> None:
    """Said (not an error: a requeued job that had finished) when the checkpoint holds --epochs already: the run
    trains nothing, and its --json holds no epoch."""
    if done >= args.epochs:
        say(f"--epochs {args.epochs}: the checkpoint is after epoch {done} already; nothing to train", flush=True)
