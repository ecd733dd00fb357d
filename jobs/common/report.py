"""Shared pieces of the benchmark jobs: size arguments, run metadata, JSON rows (atomically), PNG figures."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone


def parse_size(text: str, binary: bool) -> int:
    """'64M' -> 64 Mi (binary: bytes) or 64 000 000 (decimal: element counts); positive only."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30} if binary else \
        {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}
    text = text.strip().upper()
    if binary:
        text = text.removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in units else ""
    try:
        value = int(float(text[: len(text) - len(unit)]) * units[unit])
    except ValueError:
        example = "4K, 64M, 1G" if binary else "100000, 1M, 25M"
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: {example})") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def run_metadata(job: str, argv=None, **extra) -> dict:
    """When, where and how a benchmark ran: what BENCHMARKS.md quotes beside its figures."""
    args = sys.argv[1:] if argv is None else list(argv)
    return dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                cpus=os.cpu_count(), command=" ".join(["python", "-m", job, *args]), **extra)


def machine() -> dict:
    """The machine a benchmark ran on: cores (all, and those this process may run on), CPU model, memory."""
    model, mem_kib = None, None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            mem_kib = next((int(line.split()[1]) for line in f if line.startswith("MemTotal:")), None)
    except OSError:  # not Linux: what platform knows
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return dict(cores=os.cpu_count(), usable_cores=usable, cpu_model=model or platform.processor() or "unknown",
                memory_gib=None if mem_kib is None else round(mem_kib / 2 ** 20, 1))


def machine_line(m: dict) -> str:
    """`machine: AMD EPYC, 16 cores (16 usable), 125.8 GiB`: what a table's figures were measured on."""
    usable = "all" if m["usable_cores"] == m["cores"] else m["usable_cores"]
    memory = "" if m["memory_gib"] is None else f", {m['memory_gib']} GiB"
    return f"machine: {m['cpu_model']}, {m['cores']} cores ({usable} usable){memory}"


def write_json(path: str, meta: dict, rows: list, say=print) -> None:
    """{"meta": ..., "rows": [...]} to `path`; an interrupted run never leaves half a file (write_document)."""
    write_document(path, dict(meta=meta, rows=rows), say)


def write_document(path: str, doc: dict, say=print) -> None:
    """Any JSON document to `path`, through a temp file renamed over it: an interrupted run never leaves half a file.

    A path that exists and is not a regular file (/dev/stdout, a pipe) is written in place: renaming a
    temp file over it would replace the device.
    """
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    say(f"wrote {path}")


def save_figure(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
