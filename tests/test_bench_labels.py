"""The benchmarks' inputs, labels and comparisons: values that reached tracebacks or were ignored, the compute mode and
machine each table, figure and JSON names, and contenders timed round by round."""

from __future__ import annotations

import argparse
import importlib

import pytest

from jobs.common.compute import check_compute
from jobs.common.inputs import InputError, comma_list

EMULATION = ["--models", "mlp", "--devices", "v100", "--steps", "1", "--warmup", "0", "--no-hooked", "--waits", "10",
             "--repeats", "1", "--idles", ""]


def refused(capsys, job: str, argv: list[str]) -> str:
    """The one stderr line of a job refusing argv (exit 2, no traceback), parsed in this process."""
    module = importlib.import_module(f"jobs.{job}")
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("job,argv,message", [
    ("bench.emulation", [*EMULATION, "--waits", "abc"], "--waits: 'abc'"),
    ("bench.emulation", [*EMULATION, "--waits", "0"], "--waits: every wait count must be a whole number >= 1"),
    ("bench.emulation", [*EMULATION, "--waits", "-10"], "--waits: every wait count"),
    ("bench.emulation", [*EMULATION[:-2], "--idles", "x"], "--idles: 'x'"),
    ("bench.emulation", [*EMULATION[:-2], "--idles", "inf"], "--idles: every idle length must be >= 0 ms and finite"),
    ("bench.emulation", [*EMULATION, "--scales", "y"], "--scales: 'y'"),
    ("bench.emulation", [*EMULATION, "--scales", "inf"], "--scales: every scale must be > 0 and finite"),
    ("bench.emulation", [*EMULATION, "--waits", "10,10"], "--waits: '10' is listed twice"),
    ("bench.emulation", [*EMULATION[:2], "--devices", "v100,v100", *EMULATION[4:]], "--devices: 'v100' is listed twice"),
], ids=["waits-word", "waits-zero", "waits-negative", "idles-word", "idles-inf", "scales-word", "scales-inf",
        "waits-twice", "devices-twice"])
def test_bad_values_are_one_line_not_a_traceback(capsys, job, argv, message):
    assert message in refused(capsys, job, argv)


def test_an_infinite_compute_scale_is_refused_before_any_worker_starts():
    args = argparse.Namespace(compute="emulated:h100", compute_scale=float("inf"))
    with pytest.raises(InputError, match="--compute-scale: must be a finite number > 0"):
        check_compute(args)


def test_a_list_of_names_refuses_one_named_twice_and_a_list_of_numbers_when_asked():
    with pytest.raises(InputError, match="--impls: 'native' is listed twice"):
        comma_list("--impls", "native,ring,native", allowed=("native", "ring"))
    with pytest.raises(InputError, match="--sizes: '4096' is listed twice"):
        comma_list("--sizes", "4K,4096", parse=lambda t: 4096, unique=True)
    assert comma_list("--balance", "1,1", parse=int) == [1, 1]  # a list of counts may repeat one
