"""The `mpitrain` command: it lists every job, runs each as `python -m` would, alone and under mpiexec."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from jobs import cli
from mpicomm.launch import mpiexec

MPITRAIN = os.path.join(os.path.dirname(sys.executable), "mpitrain")
ENTRY_POINTS_ELSEWHERE = {"jobs.bench.__main__": "bench strategies", "jobs.sim.validate": "simulate --validate",
                          "jobs.sim.papers": "simulate --papers"}


def mpitrain(*args, timeout=120):
    command = [MPITRAIN] if os.path.exists(MPITRAIN) else [sys.executable, "-m", "jobs"]
    return subprocess.run([*command, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def entry_points() -> set[str]:
    """Every module of jobs/ that runs as a program (it has a `__main__` block)."""
    found = set()
    for folder, dirs, files in os.walk(os.path.join(ROOT, "jobs")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py") and f != "__main__.py" or folder != os.path.join(ROOT, "jobs") and f == "__main__.py":
                with open(os.path.join(folder, f)) as fh:
                    if '__name__ == "__main__"' in fh.read():
                        found.add(os.path.relpath(os.path.join(folder, f[:-3]), ROOT).replace(os.sep, "."))
    return found


def listed() -> dict[str, str]:
    """{module: command} of everything the command lists."""
    out = {m: n for n, m, *_ in cli.COMMANDS + cli.WORKERS if m}
    out.update({m: f"bench {n}" for n, m, *_ in cli.BENCHMARKS})
    return out


def test_every_job_is_a_command():
    missing = entry_points() - set(listed()) - set(ENTRY_POINTS_ELSEWHERE)
    assert not missing, f"jobs without an mpitrain command: {sorted(missing)}"
    assert set(listed()) <= entry_points(), "a command names a module that is not a program"


def test_help_lists_every_job_and_each_one_answers_help():
    proc = mpitrain("--help")
    assert proc.returncode == 0, proc.stderr
    for command in listed().values():  # a bench NAME is listed under the benchmarks without its "bench "
        assert re.search(rf"^  (bench )?{re.escape(command.removeprefix('bench '))} ", proc.stdout, re.M), command
    for module, command in sorted(listed().items()):
        proc = mpitrain(*command.split(), "--help")
        assert proc.returncode == 0, f"{command} --help: {proc.stderr[-1000:]}"
        assert proc.stdout.startswith(f"usage: mpitrain {command}"), proc.stdout[:200]


@pytest.mark.parametrize("args, says", [
    (["nope"], "error: mpitrain: no command named 'nope'"),
    (["bench", "nope"], "error: mpitrain bench: no benchmark named 'nope'"),
    (["train", "--epochs", "0"], "error: --epochs:"),
])
def test_bad_commands_say_so_and_exit_2(args, says):
    proc = mpitrain(*args)
    assert proc.returncode == 2 and says in proc.stderr, (proc.returncode, proc.stderr[-1000:])


def test_bench_without_a_name_lists_the_benchmarks():
    proc = mpitrain("bench")
    assert proc.returncode == 2 and "pipeline-accuracy" in proc.stdout


def test_python_dash_m_forms_still_run():
    for module in ("jobs.bench", "jobs.bench.pipeline", "jobs.train", "jobs"):
        proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT,
                              timeout=60)
        assert proc.returncode == 0 and proc.stdout.startswith("usage:"), (module, proc.stderr[-1000:])


@pytest.mark.skipif(not os.path.exists(MPITRAIN), reason="the mpitrain script is not installed (make setup)")
def test_mpiexec_runs_the_command_on_every_rank(tmp_path):
    out = tmp_path / "train.json"
    proc = subprocess.run(["timeout", "-k", "5", "240", mpiexec(), "-n", "4", MPITRAIN, "train", "--model", "mlp",
                           "--data", "synthetic", "--synthetic-samples", "512", "--batch-size", "16", "--epochs", "1",
                           "--no-progress", "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 4 and [r["epoch"] for r in doc["epochs"]] == [1], doc


def test_every_command_in_the_docs_exists():
    """README, BENCHMARKS, benchmarks/*.md, slurm/ and the jobs' docstrings: each `mpitrain X ...` names a job."""
    docs = ["README.md", "BENCHMARKS.md", "slurm/README.md"]
    docs += [os.path.join("benchmarks", f) for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".md")]
    docs += [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "jobs"))
             for f in fs if f.endswith(".py")]
    wrong = []
    for doc in docs:
        with open(os.path.join(ROOT, doc)) as f:
            for n, line in enumerate(f, 1):
                for words in re.findall(r"(?:^|[\s`(])mpitrain ((?:[a-z][\w-]*)(?: [a-z][\w-]*)?)", line):
                    argv = words.split()
                    if argv[0] in ("command", "COMMAND", "bench") and argv[1:2] in ([], ["NAME"], ["--help"]):
                        continue
                    if cli.resolve(argv) is None and cli.resolve(argv[:1]) is None:
                        wrong.append(f"{doc}:{n}: mpitrain {words}")
    assert wrong == [], "\n".join(wrong)
