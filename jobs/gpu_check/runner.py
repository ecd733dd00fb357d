"""One part of gpu-check: a command run with a time limit and its own log, whatever the others do."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

HEARTBEAT_S = 30.0  # a progress line at least this often while a part runs
MIN_START_S = 10.0  # a part is not started with less of the run's budget left: it could not finish
TAIL_LINES = 15  # of a failed part's log, in the report
# A part past its limit gets SIGINT first: the jobs end as on ^C, tearing down what they started in sessions of
# their own (an MPI job's ranks, an emulated cluster's namespaces), which the signals to the part's own group
# would not reach; then SIGTERM, then SIGKILL, each after its grace.
STOP = ((signal.SIGINT, 15.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, None))


@dataclass
class Part:
    """A command of the check. outputs: files (relative to the run's folder) it must leave; kind: how the report
    summarises it (jobs.gpu_check.report.SUMMARIES); check(log path): why a run that exited 0 failed, or None."""

    name: str
    title: str
    cmd: list[str]
    limit_s: float
    kind: str = "log"
    outputs: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    check: Callable[[str], str | None] | None = None


@dataclass
class Result:
    """How a part went: status passed, failed, timed out or not run; log relative to the run's folder."""

    name: str
    title: str
    kind: str
    command: str
    status: str
    returncode: int | None
    seconds: float
    limit_s: float
    log: str
    problem: str | None = None
    tail: list[str] = field(default_factory=list)
    outputs: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_json(self) -> dict:
        return asdict(self)


def run_part(part: Part, folder: str, budget_left_s: float, say=print, cwd: str | None = None,
             min_start_s: float = MIN_START_S, heartbeat_s: float = HEARTBEAT_S) -> Result:
    """Run `part` in its own process group, stdout and stderr to FOLDER/logs/NAME.log, for at most
    min(part.limit_s, budget_left_s) seconds (then the whole group is ended): never raises for the part's sake."""
    os.makedirs(os.path.join(folder, "logs"), exist_ok=True)
    log = os.path.join("logs", f"{part.name}.log")
    command = shlex.join(part.cmd)
    limit = min(part.limit_s, budget_left_s)
    result = Result(part.name, part.title, part.kind, command, "not run", None, 0.0, part.limit_s, log,
                    outputs=part.outputs)
    if limit < min_start_s:
        result.problem = f"not started: {max(0.0, budget_left_s):.0f} s of the run's time budget left"
        return result
    start = time.monotonic()
    with open(os.path.join(folder, log), "w") as out:
        out.write(f"$ {command}\n")
        out.flush()
        try:
            # SIGINT as the default in the part, even where this driver was started with it ignored (a
            # background job): Python then makes it a KeyboardInterrupt.
            proc = subprocess.Popen(part.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **part.env}, cwd=cwd, start_new_session=True,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        except OSError as exc:
            result.status, result.problem = "failed", f"could not start: {exc}"
            return result
        timed_out = _wait(proc, start, limit, part.name, os.path.join(folder, log), say, heartbeat_s)
    result.seconds = time.monotonic() - start
    result.returncode = proc.returncode
    result.tail = tail(os.path.join(folder, log))
    missing = [p for p in part.outputs if not os.path.exists(os.path.join(folder, p))]
    if timed_out:
        result.status, result.problem = "timed out", f"ended after its limit of {limit:.0f} s"
    elif proc.returncode != 0:
        result.status, result.problem = "failed", f"exit status {proc.returncode}"
    elif missing:
        result.status, result.problem = "failed", f"exit status 0 but did not write {', '.join(missing)}"
    elif part.check is not None and (why := part.check(os.path.join(folder, log))):
        result.status, result.problem = "failed", why
    else:
        result.status = "passed"
    return result


def _wait(proc: subprocess.Popen, start: float, limit: float, name: str, log: str, say, heartbeat_s: float) -> bool:
    """Wait for proc, a progress line every heartbeat_s; past `limit` end its process group. True if it was ended."""
    while True:
        elapsed = time.monotonic() - start
        try:
            proc.wait(timeout=max(0.1, min(heartbeat_s, limit - elapsed)))
            return False
        except subprocess.TimeoutExpired:
            pass
        elapsed = time.monotonic() - start
        if elapsed >= limit:
            _end_group(proc)
            return True
        last = tail(log, 1)
        say(f"  {name}: {elapsed:.0f} s of {limit:.0f} s" + (f" | {last[0][:100]}" if last else ""))


def _end_group(proc: subprocess.Popen) -> None:
    """STOP's signals to the part's process group, in turn, until it has ended."""
    for sig, grace in STOP:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: str, lines: int = TAIL_LINES) -> list[str]:
    """The last `lines` non-empty lines of a log (its last 64 KiB)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line.rstrip() for line in text.replace("\r", "\n").splitlines() if line.strip()][-lines:]
