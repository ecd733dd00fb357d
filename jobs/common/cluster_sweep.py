"""A benchmark driver's loop: its MPI worker across an emulated cluster at each bandwidth (or here), its ROWs."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Callable

# The workers' progress lines (rank 0's "# 12.3 s: round 1/5 p3: T_iter ..."), shown as they come: a sweep's one
# run can take half an hour.
PROGRESS = "# "


def print_row(row: dict) -> None:
    """One result, as the worker's rank 0 hands it to rows_from: a "ROW {json}" line."""
    print("ROW " + json.dumps(row), flush=True)


def rows_from(proc) -> list[dict]:
    """The worker's "ROW {json}" lines; a failed worker raises with the end of its stderr. Its warnings (a
    host too slow for the emulated device, say) are passed on to stderr, each kind once however many ranks said it."""
    if proc.returncode:
        raise RuntimeError(f"worker failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    said: dict[str, list[str]] = {}  # one per kind (its figures aside): the ranks' own figures differ
    for line in (proc.stderr or "").splitlines():
        if "Warning: " in line:
            said.setdefault(re.sub(r"\d+(\.\d+)?", "#", line), []).append(line.strip())
    for lines in said.values():
        more = f" (and {len(lines) - 1} more like it)" if len(lines) > 1 else ""
        print(f"worker: {lines[0]}{more}", file=sys.stderr, flush=True)
    return [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]


def sweep(args, command: Callable[[str, str, int], list[str]], show: Callable[[list[dict]], str],
          ranks_per_host: int = 1, runs: list[tuple[str, int]] | None = None,
          links: Callable[[str], str] | None = None,
          adjust: Callable[[list[dict], str], None] | None = None) -> tuple[list[dict], list[dict]]:
    """Rows of command(name, bandwidth label, ranks) for every --bandwidths x run (--local: this host, unshaped).

    runs: (name, ranks) pairs; by default (model, --hosts x ranks_per_host) for every --models. A run
    of n ranks gets a cluster of ceil(n / ranks_per_host) hosts, brought up for it and taken down
    after; a single rank sends nothing and runs on this host. links(bandwidth): the rate its links are
    shaped to (default: the bandwidth itself; jobs.common.carry); adjust(rows, label) edits a run's rows
    in place before they are shown. The new rows are shown (show(rows) is a markdown table) as they
    come, and with --json the rows so far are kept in PATH.partial.json (removed when the sweep ends), so a
    sweep killed from outside (a `timeout`) loses only the run it was in. A failure ends the sweep with one
    `error:` line. Returns (rows, failed): the rows measured, and the runs that failed or never ran (each
    {run, bandwidth, ranks, error}; empty when the sweep completed): the caller keeps the rows, marks its
    outputs incomplete (incomplete_meta) and exits 1 (exit_status).
    """
    from mpicomm.emulation import EmulatedCluster, EmulationError, format_bandwidth, parse_bandwidth, run_local

    rows: list[dict] = []
    failed: list[dict] = []
    grid = [(bw, bw if args.local else format_bandwidth(parse_bandwidth(bw)), name, n)
            for bw in (["local-unshaped"] if args.local else args.bandwidths)
            for name, n in runs or [(model, args.hosts * ranks_per_host) for model in args.models]]
    done = 0
    try:
        for bw, label, name, n in grid:
            print(f"# {name} at {label}, {n} rank{'s' * (n > 1)} ...", flush=True)
            cmd = command(name, label, n)
            hosts = {}  # what the emulated hosts were, for each row (none on this host alone)
            if args.local or n == 1:
                proc = run_local(cmd, n, args.timeout, capture=True, echo=PROGRESS)
            else:
                shaped = bw if links is None else links(bw)
                with EmulatedCluster(-(-n // ranks_per_host), shaped, ranks_per_host=ranks_per_host,
                                     congestion_control=getattr(args, "congestion_control", None)) as cluster:
                    proc = cluster.run(cmd, np=n, timeout=args.timeout, capture=True, echo=PROGRESS)
                # The hosts' TCP shapes what mixes traffic both ways (README, the emulated cluster).
                hosts = {"congestion_control": cluster.congestion_control_in_effect}
            new = [{**hosts, **r} for r in rows_from(proc)]
            if adjust is not None:
                adjust(new, label)
            rows += new
            print(show(new).split("\n", 2)[2], flush=True)
            keep_partial(args, rows)
            done += 1
    except (EmulationError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        # The run that failed, then those the failure left unrun: what the outputs lack.
        failed = [dict(run=name, bandwidth=label, ranks=n, error=str(exc).strip()[-500:] if i == done else "not run")
                  for i, (_, label, name, n) in enumerate(grid) if i >= done]
    finally:
        keep_partial(args, None)
    return rows, failed


def incomplete_meta(failed: list[dict]) -> dict:
    """For a JSON's meta: {} after a whole sweep; else incomplete=True and the runs that failed or never ran."""
    return dict(incomplete=True, failed_runs=failed) if failed else {}


def incomplete_note(failed: list[dict]) -> str:
    """For a table's and a figure's title: '' after a whole sweep; else which run failed and how many did not run."""
    if not failed:
        return ""
    first, rest = failed[0], len(failed) - 1
    more = f"; {rest} more run{'s' * (rest > 1)} not run" if rest else ""
    return (f"INCOMPLETE: {first['run']} at {first['bandwidth']}, {first['ranks']} rank"
            f"{'s' * (first['ranks'] > 1)} failed{more}")


def exit_status(failed: list[dict]) -> int:
    """A sweep's exit status: 0 when every run finished, 1 when one failed (2 is for bad input, refused before)."""
    return 1 if failed else 0


def partial_path(args) -> str | None:
    """Where a sweep keeps its rows so far: beside --json, or nowhere without it."""
    path = getattr(args, "json", None)
    return None if not path else os.path.splitext(path)[0] + ".partial.json"


def keep_partial(args, rows: list[dict] | None) -> None:
    """Write the rows so far (report.write_document: a kill mid-write leaves the last whole file), or remove them."""
    path = partial_path(args)
    if path is None:
        return
    if rows is None:
        if os.path.exists(path):
            os.remove(path)
        return
    from jobs.common.report import write_document

    write_document(path, {"partial": True, "argv": sys.argv[1:], "rows": rows}, say=lambda *_: None)
