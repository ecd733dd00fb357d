"""Run an MPI test command (mpiexec -prepend-rank ...); if it fails, repeat where each rank was stuck at the end.

A hang makes every rank dump its threads' stacks (faulthandler_timeout) long before pytest-timeout
ends the job, and a crashed rank dumps its own (faulthandler's fatal-signal handler), but 4 ranks' dumps
scroll far above the log's tail, which is all a CI summary keeps. So does the name of the test each rank was
in: pytest -q prints none, so each rank writes it to a file in TRACE_ENV's folder (tests/running_test.py, a plugin
that conftest.py loads), read here.
Each rank's verdict (its FAILED lines and its count) is repeated too: a test that failed on one rank alone prints
them among the other ranks' output, far above the tail.
Usage: python tests/run_mpi.py COMMAND... (its exit status is the command's).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from running_test import TRACE_ENV  # each rank writes "rank-N" in this folder with the test it is in

_RANK = re.compile(r"^\[(\d+)\] ")
_PIECE = re.compile(r"\[(\d+)\] ")
# faulthandler's header on a hang, pytest-timeout's, faulthandler's on a fatal signal (SIGSEGV, SIGABRT, ...)
_DUMP = ("Timeout (0:", "+++++ Timeout +++++", "Fatal Python error")
_FRAMES = 8  # innermost frames shown per thread, pytest's and pluggy's left out
_HEADS = ("Thread ", "Current thread", "~~~")
_NOISE = ("/_pytest/", "/pytest/", "/pluggy/", "/mpi4py/", "<frozen ", "/threading.py")


def streams(lines: list[str]) -> dict[int, list[str]]:
    """Each rank's own lines, from mpiexec -prepend-rank's output: it prefixes each piece a rank writes, and
    faulthandler writes a frame in pieces, so a line may hold pieces of several ranks ('[1] Thread 0x7f[0]
    Timeout ...'): each piece goes to its rank, the line's end to its last piece's."""
    text: dict[int, list[str]] = defaultdict(list)
    for line in lines:
        if not _RANK.match(line):
            continue
        pieces = _PIECE.split(line.rstrip("\n"))[1:]  # (rank, piece) pairs
        for rank, piece in zip(pieces[::2], pieces[1::2]):
            text[int(rank)].append(piece)
        text[int(pieces[-2])].append("\n")
    return {rank: "".join(parts).splitlines() for rank, parts in text.items()}


def stuck(lines: list[str]) -> dict[int, list[str]]:
    """Each rank's last stack dump of each kind, its threads' innermost frames."""
    found: dict[int, list[str]] = {}
    for rank, own in sorted(streams(lines).items()):
        dumps, current = {}, None
        for text in own:
            kind = next((mark for mark in _DUMP if mark in text), None)
            if kind is not None and not (current is dumps.get(kind) and kind == _DUMP[1]):
                current = dumps[kind] = [text]
            elif current is not None and (not text.strip() or text.startswith((" ", *_HEADS))):
                current.append(text)  # a dump goes on as long as its lines look like one
            else:
                current = None  # pytest-timeout's closing line, or the log going on
        if dumps:
            found[rank] = [line for kind in _DUMP if kind in dumps for line in _trim(dumps[kind])]
    return found


def _trim(dump: list[str]) -> list[str]:
    """Headers, and each thread's innermost frames: faulthandler lists them first, pytest-timeout last."""
    out, frames, innermost_first = [], [], True

    def flush():
        out.extend("  " + f for f in (frames[:_FRAMES] if innermost_first else frames[-_FRAMES:]))
        frames.clear()

    for text in dump:
        s = text.strip()
        if s.startswith(_HEADS) or any(mark in s for mark in _DUMP):
            flush()
            out.append(s)
            innermost_first = not s.startswith("~~~")
        elif s.startswith("File ") and not any(n in s for n in _NOISE):
            frames.append(s)
    flush()
    return out


# pytest's FAILED/ERROR lines and its count; conftest.py's leak report (mpicomm.shutdown.PREFIX, not imported: that
# would start MPI here). A rank other than 0 writes its report only if it failed, each line after "[rank N] ".
_OUTCOME = re.compile(r"^(FAILED|ERROR|INTERNALERROR) |^=*\s*\d+ (passed|failed|errors?|skipped|deselected)\b.* in "
                      r"|^\[mpitrain\] left at exit")
_OWN_PREFIX = re.compile(r"^\[rank \d+\] ")


def outcomes(lines: list[str]) -> dict[int, list[str]]:
    """Each rank's verdict lines: its FAILED and ERROR ones (pytest's short summary), what it left behind, its
    closing count. A test that fails on one rank alone prints them far above the tail, among the other ranks'."""
    found = {}
    for rank, own in sorted(streams(lines).items()):
        kept = [t for t in (_OWN_PREFIX.sub("", text.strip()) for text in own) if _OUTCOME.match(t)]
        if kept:
            found[rank] = kept[:20] + ([f"... {len(kept) - 20} more"] if len(kept) > 20 else [])
    return found


def in_progress(folder: str, now: float) -> list[str]:
    """Each rank's test at the end, from the files the ranks wrote ("start-time nodeid"; "-" after its last)."""
    out = []
    for name in sorted(os.listdir(folder), key=lambda n: int(n.rpartition("-")[2])):
        with open(os.path.join(folder, name)) as f:
            started, _, nodeid = f.read().strip().partition(" ")
        where = "between tests" if nodeid in ("", "-") else f"in {nodeid}, for {now - float(started):.0f} s"
        out.append(f"{name.replace('-', ' ')}: {where}")
    return out


def main(argv: list[str]) -> int:
    if not argv:
        sys.exit("usage: run_mpi.py COMMAND...")
    lines = []
    with tempfile.TemporaryDirectory(prefix="mpitrain-tests-") as trace:
        env = dict(os.environ, **{TRACE_ENV: trace})
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                              env=env) as p:
            for line in p.stdout:
                sys.stdout.write(line)
                lines.append(line)
        if p.returncode != 0:
            found = stuck(lines)
            print(f"\n=== the MPI run failed (exit {p.returncode}); where each rank was when it hung or crashed "
                  f"({len(found)} dumped) ===")
            print("\n".join(in_progress(trace, time.time())))
            for rank, kept in outcomes(lines).items():
                print("\n".join(f"rank {rank}: {text}" for text in kept))
            for rank, dump in found.items():
                print(f"--- rank {rank}")
                print("\n".join(dump))
            sys.stdout.flush()
    return p.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
