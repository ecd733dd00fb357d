"""The benchmarks' inputs, labels and comparisons: values that reached tracebacks or were ignored, the compute mode and
machine each table, figure and JSON names, and contenders timed round by round."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from mpicomm.launch import mpiexec

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
    ("bench.emulation", [*EMULATION[:2], "--devices", "v100,v100", *EMULATION[4:]],
     "--devices: 'v100' is listed twice"),
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


COLLECTIVES = ["--ops", "allreduce", "--sizes", "4K", "--rounds", "1", "--iters", "1", "--warmup", "0"]


@pytest.mark.parametrize("argv,message", [
    (["--impls", "native", "--latency-bytes", "4K"], "--latency-bytes: is the ring impl's crossover"),
    (["--impls", "native,gloo", "--chunk-bytes", "1M"], "--chunk-bytes: applies to mpicomm's impls"),
    (["--impls", "native", "--no-validate"], "--no-validate: applies to mpicomm's impls"),
    (["--impls", "native,native"], "--impls: 'native' is listed twice"),
    (["--sizes", "4K,4096"], "--sizes: '4096' is listed twice"),
    (["--link-gbps", "inf"], "--link-gbps: must be a finite number > 0"),
], ids=["latency-without-ring", "chunk-without-mpicomm", "no-validate-without-mpicomm", "impl-twice", "size-twice",
        "link-inf"])
def test_collectives_refuses_settings_of_impls_it_does_not_run(capsys, argv, message):
    assert message in refused(capsys, "bench.collectives", [*COLLECTIVES, *argv])


def test_collectives_plots_every_impl_of_its_rows(tmp_path, monkeypatch):
    from jobs.bench import collectives_report

    figures = []
    monkeypatch.setattr(collectives_report, "save_figure", lambda fig, path: figures.append(fig))
    impls = ["native", "hierarchical-window", "hierarchical-messages", "made-up"]
    rows = [dict(op="allreduce", impl=i, bytes=b, busbw_gbps=1.0) for i in impls for b in (4096, 65536)]
    collectives_report.plot(rows, str(tmp_path / "c.png"), "title")
    assert [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()] == impls
    table = collectives_report.format_table([dict(rows[4], ranks=2, time_s=1e-3, algbw_gbps=1.0)]).splitlines()
    assert table[2].split()[:2] == ["allreduce", "hierarchical-messages"]  # the name in its own column


def test_collectives_names_machine_and_compute_and_only_the_settings_that_ran(tmp_path):
    out = tmp_path / "c.json"
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "jobs.bench.collectives", *COLLECTIVES,
                           "--impls", "native", "--json", str(out)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = [line for line in proc.stdout.splitlines() if line.startswith("#")]
    assert header[0].startswith("# machine: ") and "real compute, CPU" in header[0]
    assert not any("chunk" in line or "validate" in line for line in header)  # no mpicomm impl ran
    meta = json.loads(out.read_text())["meta"]
    assert meta["compute"] == "real compute, CPU" and meta["machine"]["cores"] >= 1
    assert meta["chunk_bytes"] is None and meta["validate"] is None


@pytest.mark.parametrize("argv,message", [
    (["--configs", "allreduce,topk::117"], "--configs: topk ramp 117: a ramp falls to a density"),
    (["--configs", "allreduce:0.01:50"], "--configs: allreduce sends every gradient"),
    (["--configs", "wfbp:0.1"], "--configs: wfbp sends every gradient"),
    (["--configs", "allreduce,topk:0.01,topk:0.010"], "--configs: 'topk:0.010' is listed twice"),
    (["--seeds", "0,0"], "--seeds: '0' is listed twice"),
], ids=["ramp-without-density", "density-for-allreduce", "density-for-wfbp", "config-twice", "seed-twice"])
def test_convergence_refuses_what_its_training_runs_would_ignore(capsys, argv, message):
    assert message in refused(capsys, "bench.convergence", argv)


def figure_titles(monkeypatch, module) -> list:
    """The titles (suptitle, then each axis's) of every figure `module` saves, instead of saving it."""
    titles = []

    def keep(fig, path):
        titles.append(" ".join([fig._suptitle.get_text() if fig._suptitle else ""]
                               + [ax.get_title() for ax in fig.axes]))
    monkeypatch.setattr(module, "save_figure", keep)
    return titles


def test_convergence_names_the_machine_and_compute_in_its_figure(tmp_path, monkeypatch):
    from jobs.bench import convergence
    from jobs.common.compute import where_and_how

    titles = figure_titles(monkeypatch, convergence)
    configs = [("allreduce", None, 0)]
    rows = [dict(config="allreduce", test_accuracy=0.8)]
    convergence.plot(rows, configs, str(tmp_path / "p.png"), where_and_how())
    assert "machine: " in titles[0] and "real compute, CPU" in titles[0]


def test_pipeline_accuracy_help_quotes_the_tasks_own_epochs_and_rates(capsys):
    from jobs.bench.pipeline_accuracy import parse_args
    from jobs.bench.pipeline_accuracy_tasks import TASKS

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: each task's, " + ", ".join(f"{t} {TASKS[t].epochs}" for t in TASKS) + ")" in text
    assert "default: each task's, " + ", ".join(f"{t} {TASKS[t].lr:g}" for t in TASKS) + ")" in text
    assert "momentum, every method (default 0.9)" in text


def test_pipeline_accuracy_refuses_an_infinite_rate_and_names_machine_and_compute(capsys, tmp_path, monkeypatch):
    from jobs.bench import pipeline_accuracy
    from jobs.common.compute import where_and_how

    assert "--lr: must be a finite number > 0" in refused(capsys, "bench.pipeline_accuracy", ["--lr", "inf"])
    titles = figure_titles(monkeypatch, pipeline_accuracy)
    rows = [dict(task="fc", method="dp", runs=[dict(epochs=[dict(val_acc=0.5), dict(val_acc=0.6)])])]
    meta = dict(where_and_how(), ranks=4, settings=dict(seeds=1))
    pipeline_accuracy.plot(rows, ["fc"], ["dp"], str(tmp_path / "a.png"), meta)
    assert "machine: " in titles[0] and "real compute, CPU" in titles[0] and "4 ranks" in titles[0]


def test_pipeline_defaults_figure_names_the_machine_and_compute(tmp_path, monkeypatch, capsys):
    from jobs.bench import pipeline_defaults

    titles = figure_titles(monkeypatch, pipeline_defaults)
    rows = [dict(model="mlp", mode="flush", seed=0, test_accuracy=0.8, stopped=None)]
    pipeline_defaults.plot(rows, ["mlp"], ["flush"], str(tmp_path / "p.png"))
    assert "machine: " in titles[0] and "real compute, CPU" in titles[0]
    assert "--seeds: '1' is listed twice" in refused(capsys, "bench.pipeline_defaults", ["--seeds", "1,1"])


@pytest.mark.parametrize("argv,message", [
    (["--parts", "tests-serial", "--bandwidth", "1gbit"], "--bandwidth: shapes the throughput and xcheck parts' links"),
    (["--parts", "throughput", "--bandwidth", "fast"], "--bandwidth: "),
    (["--parts", "mstopk,mstopk"], "--parts: 'mstopk' is listed twice"),
], ids=["bandwidth-without-its-parts", "bandwidth-unparseable", "part-twice"])
def test_gpu_check_checks_its_bandwidth_before_the_gpu(capsys, argv, message):
    err = refused(capsys, "gpu_check.main", argv)
    assert message in err and "CUDA" not in err


def test_pto_alternates_the_two_steps_round_by_round_and_reports_the_median_ratio(tmp_path):
    import statistics

    from jobs.common.stats import median_ci

    out = tmp_path / "pto.json"
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "jobs.bench.pto", "--model", "mlp",
                           "--optimizers", "sgd-momentum", "--rounds", "3", "--repeats", "1", "--warmup", "0",
                           "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    row, meta = doc["rows"][0], doc["meta"]
    assert row["round_orders"] == [["unsharded", "pto"], ["pto", "unsharded"], ["unsharded", "pto"]]
    assert len(row["round_ratios"]) == 3 and row["speedup"] == statistics.median(row["round_ratios"])
    assert row["speedup_ci"] == list(median_ci(row["round_ratios"])[:2]) and row["speedup_coverage"] == 0.75
    assert meta["rounds"] == 3 and meta["compute"] == "real compute, CPU" and meta["machine"]["cores"] >= 1
    assert "machine: " in proc.stdout and "a 75 % CI (95 % needs >= 6 rounds)" in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_pto_refuses_an_optimizer_twice_and_no_rounds(capsys):
    assert "--optimizers: 'adam' is listed twice" in refused(capsys, "bench.pto", ["--optimizers", "adam,adam"])
    assert "--rounds: must be >= 1" in refused(capsys, "bench.pto", ["--rounds", "0"])


def test_emulation_interleaves_what_it_compares_and_names_the_machine(tmp_path, capsys, monkeypatch):
    from jobs.bench import emulation
    from runtime.emulate import accelerator

    titles = figure_titles(monkeypatch, emulation)
    out = tmp_path / "e.json"
    argv = ["--models", "mlp", "--devices", "v100", "--steps", "1", "--warmup", "0", "--waits", "10",
            "--repeats", "3", "--idles", "", "--scales", "2", "--json", str(out)]
    try:
        assert emulation.main(argv) == 0
    finally:
        accelerator.deactivate()
    doc = json.loads(out.read_text())
    waits = [r for r in doc["rows"] if r["table"] == "waits"]
    assert sorted(r["first_in"] for r in waits) == [1, 2]  # each way first in some repeat: alternating
    steps = [r for r in doc["rows"] if r["table"] in ("steps", "scales")]
    assert [r["hooks"] for r in steps] == [*emulation.HOOKS, "none"] and steps[-1]["compute_scale"] == 2
    for r in steps:  # every variant ran once a round, not all its steps in one block
        assert r["rounds"] == 3 and len(r["block_errors"]) == 3
    # a rotated order: each variant at more than one position, and the rounds not all in one order
    assert all(len(set(r["round_positions"])) > 1 for r in steps)
    assert len({tuple(r["round_positions"][k] for r in steps) for k in range(3)}) == 3
    assert doc["meta"]["machine"]["cores"] >= 1
    assert "emulated compute: v100" in doc["meta"]["compute"]
    assert "machine: " in titles[0] and "emulated compute: v100" in titles[0]
    assert capsys.readouterr().out.startswith("# machine: ")
