"""What a pytest run's log says: its summary line, its FAILED/ERROR lines, whether any test passed."""

from __future__ import annotations

import re

_SUMMARY = re.compile(r"\b\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s")
_PASSED = re.compile(r"\b[1-9]\d* passed\b")


def read(path: str) -> list[str]:
    """The log's lines; under mpiexec -prepend-rank, rank 0's (the one that reports)."""
    with open(path, errors="replace") as f:
        lines = [line.rstrip() for line in f]
    if any(line.startswith("[0] ") for line in lines):
        lines = [line[4:] for line in lines if line.startswith("[0] ")]
    return lines


def summary(lines: list[str]) -> str | None:
    """`34 passed, 2 skipped in 86.20s`: pytest's last summary line, or None (it did not get that far)."""
    return next((line.strip("= ") for line in reversed(lines) if _SUMMARY.search(line)), None)


def failures(lines: list[str]) -> list[str]:
    """The FAILED and ERROR lines of -rfE's short summary, each once."""
    return list(dict.fromkeys(line for line in lines if line.startswith(("FAILED ", "ERROR "))))


def none_passed(path: str) -> str | None:
    """Why a run that exited 0 checked nothing: every selected test skipped (a GPU the tests did not see)."""
    found = summary(read(path))
    if found is None or not _PASSED.search(found):
        return f"no test passed ({found or 'no summary line'}): did the tests see the GPU?"
    return None
