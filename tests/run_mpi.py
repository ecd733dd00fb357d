"""Run an MPI test command (mpiexec -prepend-rank ...); if it fails, repeat where each rank was stuck at the end.

A hang makes every rank dump its threads' stacks (faulthandler_timeout) long before pytest-timeout
ends the job, but 4 ranks' dumps scroll far above the log's tail, which is all a CI summary keeps.
Usage: python tests/run_mpi.py COMMAND... (its exit status is the command's).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict

_RANK = re.compile(r"^\[(\d+)\] ?(.*)$")
_DUMP = ("Timeout (0:", "+++++ Timeout +++++")  # faulthandler's header, pytest-timeout's
_FRAMES = 8  # innermost frames shown per thread, pytest's and pluggy's left out
_HEADS = ("Thread ", "Current thread", "~~~")
_NOISE = ("/_pytest/", "/pytest/", "/pluggy/", "/mpi4py/", "<frozen ", "/threading.py")


def stuck(lines: list[str]) -> dict[int, list[str]]:
    """Each rank's last stack dump of each kind, its threads' innermost frames (the lines are '[rank] text')."""
    dumps: dict[int, dict[str, list[str]]] = defaultdict(dict)
    current: dict[int, list[str] | None] = defaultdict(lambda: None)
    for line in lines:
        m = _RANK.match(line.rstrip("\n"))
        if not m:
            continue
        rank = int(m.group(1))
        # faulthandler writes a frame in pieces, and mpiexec -prepend-rank prefixes each piece.
        text = m.group(2).replace(f"[{rank}] ", "")
        kind = next((mark for mark in _DUMP if mark in text), None)
        if kind is not None and not (current[rank] is dumps[rank].get(kind) and kind == _DUMP[1]):
            current[rank] = dumps[rank][kind] = [text]
        elif current[rank] is not None and (not text.strip() or text.startswith((" ", *_HEADS))):
            current[rank].append(text)  # a dump goes on as long as its lines look like one
        else:
            current[rank] = None  # pytest-timeout's closing line, or the log going on
    return {rank: [line for kind in _DUMP if kind in found for line in _trim(found[kind])]
            for rank, found in sorted(dumps.items())}


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


def main(argv: list[str]) -> int:
    if not argv:
        sys.exit("usage: run_mpi.py COMMAND...")
    lines = []
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") as p:
        for line in p.stdout:
            sys.stdout.write(line)
            lines.append(line)
    if p.returncode != 0:
        found = stuck(lines)
        print(f"\n=== the MPI run failed (exit {p.returncode}); where each rank was when it hung "
              f"({len(found)} dumped) ===")
        for rank, dump in found.items():
            print(f"--- rank {rank}")
            print("\n".join(dump))
        sys.stdout.flush()
    return p.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
