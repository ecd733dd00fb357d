"""Writing a job's output files: a write that fails stops every rank with one line, not a traceback or a hang."""

from __future__ import annotations

import json
import os
import sys
from typing import Callable

WRITE_FAILED = 1  # exit status when an output could not be written (bad input is 2)


def write_together(comm, opt: str, path: str, write: Callable[[], object], here: bool = True) -> None:
    """Run `write` (this rank's part of the output at `path`; not if here=False), then agree across `comm`.

    The inputs were checked at start-up, but a disk fills and permissions change: if `write` raises
    OSError on any rank, that rank prints `error: --option: cannot write PATH: reason` and every rank
    exits 1 together. A rank that raised alone would leave the others waiting in their next
    collective. comm=None for a job that runs as one process.
    """
    problem = None
    if here:
        try:
            write()
        except OSError as exc:
            problem = f"{opt}: cannot write {path}: {exc.strerror or exc}"
            print(f"error: {problem}", file=sys.stderr, flush=True)
    if comm is not None:
        from mpicomm.agree import fail_together

        try:
            fail_together(comm, problem)
        except RuntimeError as exc:  # another rank's write failed; that rank said which
            problem = problem or str(exc)
    if problem is not None:
        sys.exit(WRITE_FAILED)


def write_results(comm, args, meta: dict, rows: list, draw: Callable[[str], object], say=print) -> None:
    """A benchmark's usual outputs from rank 0: rows and metadata to --json, draw(path) to --plot; fail together."""
    from jobs.common.report import write_json

    here = comm is None or comm.Get_rank() == 0
    if args.json:
        write_together(comm, "--json", args.json, lambda: write_json(args.json, meta, rows, say), here=here)
    if args.plot:
        write_together(comm, "--plot", args.plot, lambda: (draw(args.plot), say(f"wrote {args.plot}")), here=here)


def write_timeline(comm, path: str, timeline, say=print) -> None:
    """A job's --timeline: each rank writes its part, rank 0 merges them into `path` and removes the parts."""
    from runtime.trace.timeline import merge

    rank, size = comm.Get_rank(), comm.Get_size()
    parts = [f"{path}.rank{r}.json" for r in range(size)]
    write_together(comm, "--timeline", parts[rank], lambda: timeline.dump(parts[rank]))

    def merge_parts():
        merge(parts, path)
        for part in parts:
            os.remove(part)
        say(f"wrote {path} (open in https://ui.perfetto.dev or chrome://tracing)")
    write_together(comm, "--timeline", path, merge_parts, here=rank == 0)


def write_training_outputs(comm, args, timeline, metrics: dict, say=print) -> None:
    """A training job's --timeline (write_timeline) and --json (`metrics`, by rank 0)."""
    if timeline is not None and args.timeline:
        write_timeline(comm, args.timeline, timeline, say)
    if args.json:
        def write_metrics():
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(metrics, f, indent=1)
            say(f"wrote {args.json}")  # as the other jobs say each output they write
        write_together(comm, "--json", args.json, write_metrics, here=comm.Get_rank() == 0)
