"""jobs.train end to end under mpiexec: metrics, checkpoint and resume, the merged timeline, bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, exit_in_process
from mpicomm.launch import mpiexec

QUICK = ["--model", "mlp", "--data", "synthetic", "--synthetic-samples", "512", "--batch-size", "32",
         "--no-progress"]


def train(tmp_path, *args, n=2, timeout=180):
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "jobs.train", *QUICK, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


# p3 with its credit online: 32 steps, so that its trials (28) end and the choice is said
@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "p3 --credit online --synthetic-samples 1024",
                                      "topk --density 0.1", "hier-topk --density 0.1", "allreduce --pto"])
def test_trains_and_reports_every_epoch(tmp_path, strategy):
    out = tmp_path / "m.json"
    proc = train(tmp_path, "--strategy", *strategy.split(), "--epochs", "2", "--json", str(out))
    doc = json.loads(out.read_text())
    rows = doc["epochs"]
    assert "plan" not in doc and "hybcomm plan:" not in proc.stdout  # hybcomm's alone
    assert [r["epoch"] for r in rows] == [1, 2]
    assert rows[1]["loss"] < rows[0]["loss"]  # the synthetic classes are learnable
    assert all(r["test_targets"] == 256 and 0 <= r["test_accuracy"] <= 1 and r["samples_per_s"] > 0 for r in rows)
    assert "epoch 2: loss" in proc.stdout
    if "online" in strategy:
        said = [line for line in proc.stdout.splitlines() if line.startswith("p3: credit online:")]
        assert len(said) == 1 and " chose " in said[0], proc.stdout  # rank 0, once
        assert doc["p3"]["online"] == said[0].removeprefix("p3: ") and "online trials" in doc["p3"]["settings"]
    assert ("p3" in doc) == strategy.startswith("p3")


def test_emulated_compute_reports_throughput_and_says_scores_are_meaningless(tmp_path):
    """--compute emulated:v100: the epoch line and --json name the compute; no loss or accuracy as if real."""
    out = tmp_path / "m.json"
    proc = train(tmp_path, "--compute", "emulated:v100", "--epochs", "1", "--max-steps", "3", "--json", str(out))
    doc = json.loads(out.read_text())
    assert proc.stdout.count("loss and accuracy are meaningless under emulation") == 1  # rank 0, once
    assert "test accuracy" not in proc.stdout and "epoch 1: [emulated compute: " in proc.stdout
    assert doc["compute_device"] == "v100" and "layers" in doc["emulated_parts"]
    (row,) = doc["epochs"]
    assert row["loss"] is None and row["test_accuracy"] is None and row["samples_per_s"] > 0


def test_emulated_progress_lines_show_no_loss_and_the_json_written_is_said(tmp_path):
    """In a log file, under emulated compute, the progress lines name no loss (none is computed; they said "loss
    0.000"); --json's path is said once written, as the other jobs say theirs."""
    out = tmp_path / "m.json"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "jobs.train", *[a for a in QUICK if a != "--no-progress"],
           "--compute", "emulated:v100", "--epochs", "1", "--max-steps", "4", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch 1/1 (emulated: loss not computed): ")]
    assert len(lines) == 3 and all(line.endswith(" samples/s") and ", loss " not in line for line in lines), proc.stdout
    assert proc.stdout.splitlines()[-1] == f"wrote {out}" and proc.stdout.count("wrote ") == 1, proc.stdout


def test_hybcomm_prints_its_plan_and_records_it(tmp_path):
    """4 ranks: rank 0 prints the plan after the first step (the batch never changes: once) and --json holds it."""
    out = tmp_path / "m.json"
    proc = train(tmp_path, "--strategy", "hybcomm", "--hybcomm-force", "sfb", "--link-bandwidth", "1gbit",
                 "--epochs", "1", "--max-steps", "3", "--json", str(out), n=4)
    doc = json.loads(out.read_text())
    assert proc.stdout.count("hybcomm plan:") == 1 and "epoch 1: loss" in proc.stdout
    assert (doc["args"]["hybcomm_force"], doc["args"]["link_bandwidth_bps"]) == ("sfb", 1_000_000_000)
    plan = doc["plan"]
    assert {(p["name"], p["M"], p["N"], p["choice"]) for p in plan} == {("net.1", 784, 256, "sfb"),
                                                                       ("net.3", 256, 10, "sfb")}
    assert isinstance(doc["plan_version"], int) and len(doc["epochs"]) == 1


def test_plan_watch_says_each_new_plan_once():
    """As jobs.train's rank 0 calls it after every step: nothing before a plan or without one, each version once."""
    from types import SimpleNamespace

    from jobs.common.plans import PlanWatch

    said = []
    strategy = SimpleNamespace(plan=None, plan_version=0, plan_text=lambda: f"table {strategy.plan_version}")
    watch = PlanWatch(strategy, lambda text, flush: said.append(text))
    watch.check()
    strategy.plan, strategy.plan_version = ["layer"], 1
    watch.check(), watch.check()
    strategy.plan_version = 2  # a new batch size: a new plan
    watch.check()
    PlanWatch(SimpleNamespace(), said.append).check()  # wfbp: no plan at all
    assert said == ["hybcomm plan:\ntable 1", "hybcomm plan:\ntable 2"]


@pytest.mark.parametrize("extra", [[], ["--pto", "--optimizer", "adam", "--lr", "0.01"]], ids=["p3", "pto-adam"])
def test_resume_continues_exactly(tmp_path, extra):
    """Under --pto the optimizer state is sharded: the checkpoint gathers it, --resume shards it again."""
    straight, split = tmp_path / "a.pt", tmp_path / "b.pt"
    train(tmp_path, "--epochs", "3", "--checkpoint", str(straight), *extra)
    train(tmp_path, "--epochs", "2", "--checkpoint", str(split), *extra)
    proc = train(tmp_path, "--epochs", "3", "--checkpoint", str(split), "--resume", *extra)
    assert "resumed from" in proc.stdout and "epoch 3: loss" in proc.stdout and "epoch 1:" not in proc.stdout
    a, b = torch.load(straight, weights_only=False), torch.load(split, weights_only=False)
    assert a["epoch"] == b["epoch"] == 2
    for k in a["model"]:
        assert torch.allclose(a["model"][k], b["model"][k], rtol=1e-6, atol=1e-7), k


def test_timeline_has_a_track_per_rank_with_layers_and_slices(tmp_path):
    trace = tmp_path / "t" / "trace.json"
    train(tmp_path, "--strategy", "p3", "--slice-size", "5000", "--max-steps", "3", "--timeline", str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    names = {e["name"].split()[0] for e in spans}
    assert {"forward", "backward", "push", "pull", "wait"} <= names, names
    assert not list(trace.parent.glob("*.rank*.json"))  # per-rank parts merged and removed


@pytest.mark.parametrize("args,message", [(["--strategy", "nope"], "--strategy: unknown 'nope'"),
                                          (["--resume"], "--resume: needs --checkpoint"),
                                          (["--batch-size", "0"], "--batch-size: must be >= 1"),
                                          (["--density", "0"], "--density: must be in (0, 1]"),
                                          (["--density", "1.5"], "--density: must be in (0, 1]"),
                                          (["--compute", "emulated:nonesuch"], "--compute: unknown device 'nonesuch'"),
                                          (["--compute", "emulated:v100", "--parallel", "pipeline"],
                                           "--compute: emulated compute trains data parallel only for now")])
def test_bad_arguments(args, message, capsys):
    from jobs.train import main

    code, out, err = exit_in_process(main, [*QUICK, *args], capsys)
    assert code == 2 and message in err and err.count("\n") == 1 and out == "", err


PIPE = ["--parallel", "pipeline"]


@pytest.mark.parametrize("args,message", [
    (["--spectrain-variant", "once"], "--spectrain-variant: needs --parallel pipeline"),
    ([*PIPE, "--spectrain-variant", "once"], "--spectrain-variant: needs --pipeline-mode spectrain"),
    (["--strategy", "wfbp", "--credit", "online"], "--credit: needs --strategy p3"),
    (["--strategy", "wfbp", "--slice-size", "100"], "--slice-size: needs --strategy p3"),
    (["--strategy", "hybcomm", "--slice-size", "100"], "--slice-size: needs --strategy p3 (or --strategy hybcomm "
                                                       "--hybcomm-dense p3)"),
    (["--density", "0.5"], "--density: needs --strategy topk or hier-topk"),
    (["--strategy", "allreduce", "--no-error-feedback"], "--no-error-feedback: needs --strategy topk or hier-topk"),
    (["--topk-granularity", "layer"], "--topk-granularity: needs --strategy topk or hier-topk"),
    (["--prefetch", "2"], "--prefetch: needs --cache-dir"),
    (["--cache-memory-mb", "10"], "--cache-memory-mb: needs --cache-dir"),
    (["--optimizer", "adam", "--momentum", "0.5"], "--momentum: needs --optimizer sgd"),
    ([*PIPE, "--density", "0.5", "--topk-operator", "exact"], "--density: is not available with --parallel pipeline"),
    ([*PIPE, "--strategy", "p3", "--slice-size", "1000"], "--strategy: with --parallel pipeline, replicas average "
                                                          "gradients with allreduce or wfbp"),
    ([*PIPE, "--strategy", "wfbp"], "--strategy: with --parallel pipeline, it is how --replicas average gradients: "
                                    "needs --replicas 2 or more"),
], ids=lambda v: None if isinstance(v, list) else v.split(":")[0])
def test_options_that_do_not_apply_are_refused(args, message, capsys):
    """Each of these once ran to completion without effect: one line and exit 2 instead, before MPI starts."""
    from jobs.train import main

    code, out, err = exit_in_process(main, [*QUICK, *args], capsys)
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1 and out == "", err


def test_options_take_their_defaults_where_they_apply():
    """What the help says: p3 by default (its auto slice and credit), topk's density 0.01, SGD's momentum 0.9; the
    pipeline's replicas average with allreduce, spectrain predicts as the paper does; None where they do not apply."""
    from jobs.train import parse_args

    args = parse_args(QUICK)
    assert (args.strategy, args.slice_size, args.credit, args.momentum, args.density, args.prefetch) == \
        ("p3", "auto", "auto", 0.9, None, None)
    args = parse_args([*QUICK, "--strategy", "topk"])
    assert (args.density, args.no_error_feedback, args.dense_warmup_steps, args.density_ramp_steps,
            args.topk_granularity, args.topk_operator, args.slice_size) == (0.01, False, 0, 0, "model", "mstopk", None)
    assert parse_args([*QUICK, "--optimizer", "adam"]).momentum is None
    args = parse_args([*QUICK, *PIPE, "--pipeline-mode", "spectrain"])
    assert (args.strategy, args.spectrain_variant, args.slice_size) == ("allreduce", "paper", None)
    assert parse_args([*QUICK, *PIPE]).spectrain_variant is None


@pytest.mark.parametrize("args,message", [
    (["--synthetic-samples", "10", "--batch-size", "64"], "64 per rank x 1 ranks = 64"),
    ([*PIPE, "--synthetic-samples", "10", "--batch-size", "64"], "64 per replica x 1 replicas = 64"),
    (["--compute", "emulated:v100", "--synthetic-samples", "10", "--batch-size", "64"], "64 per rank x 1 ranks"),
], ids=["data", "pipeline", "emulated"])
def test_fewer_synthetic_samples_than_one_global_batch_is_refused_before_mpi(args, message, capsys):
    """It was a traceback once MPI, the optimizer and p3's progress thread were up (left running at exit)."""
    from jobs.train import main

    code, out, err = exit_in_process(main, [*QUICK, *args], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: --synthetic-samples: 10 training samples are fewer than one global batch (") \
        and message in err, err


@pytest.mark.timeout(150)
def test_too_small_a_training_set_is_one_line_on_every_rank_under_mpi():
    """Synthetic: counted against the ranks mpiexec launched, before MPI starts. A dataset (Fashion-MNIST's 60,000):
    counted once loaded, every rank stopping together before the optimizer starts a thread; nothing left running."""
    cases = [(["--data", "synthetic", "--synthetic-samples", "100"],
              "error: --synthetic-samples: 100 training samples are fewer than one global batch (64 per rank x 2 ranks "
              "= 128)")]
    if os.path.isdir("/usr/share/datasets/fashion-mnist"):
        cases.append((["--batch-size", "30001"], "error: --batch-size: 60000 training samples are fewer than one "
                                                 "global batch (30001 per rank x 2 ranks = 60002)"))
    for args, line in cases:
        cmd = ["timeout", "-k", "5", "120", mpiexec(), "-n", "2", sys.executable, "-m", "jobs.train", "--no-progress",
               "--epochs", "1", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [line], proc.stderr[-3000:]


def test_bad_arguments_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "jobs.train", *QUICK, "--batch-size", "0"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and proc.stderr == "error: --batch-size: must be >= 1, got 0\n", proc.stderr


def test_nan_gradient_stops_sparse_training_with_the_layer_named(tmp_path):
    """A learning rate that blows the loss up: every rank stops, naming the first non-finite layer."""
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "jobs.train", *QUICK, "--strategy", "topk", "--lr", "1e30",
           "--momentum", "0", "--epochs", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 3 and "error: step " in proc.stderr
    assert "non-finite gradient (NaN or Inf) in" in proc.stderr and "Traceback" not in proc.stderr


def test_convergence_bench_rows_and_plot(tmp_path):
    out = tmp_path / "conv.json"
    cmd = [sys.executable, "-m", "jobs.bench.convergence", "--configs", "allreduce,hier-topk:0.1:3", "--seeds", "0",
           "--epochs", "1", "--max-steps", "5", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    if "fashion-mnist" in proc.stderr.lower() and proc.returncode:
        pytest.skip("Fashion-MNIST is not installed (make setup installs it as root)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["strategy"], r["density"], r["ramp_steps"]) for r in rows] == [("allreduce", None, 0), ("hier-topk", 0.1, 3)]
    assert all(0 < r["test_accuracy"] <= 1 for r in rows)
    assert "| hier-topk ρ=0.1 ramp 3 |" in proc.stdout and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_training_reads_through_the_cache(tmp_path):
    """--cache-dir: epoch 1 fills every rank's shard, epoch 2 is served warm; a second job starts warm."""
    from datacache_helpers import make_png_dataset

    if not os.path.isdir("/usr/share/datasets/fashion-mnist"):
        pytest.skip("Fashion-MNIST is not installed (make setup installs it as root)")
    src = make_png_dataset(tmp_path / "png", n=300, size=28)
    for run in range(2):
        out = tmp_path / f"m{run}.json"
        cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "jobs.train", "--cache-dir", str(tmp_path / "cache"),
               "--data-dir", src, "--epochs", "2", "--batch-size", "16", "--no-progress", "--json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = json.loads(out.read_text())["epochs"]
        assert [r["cache_state"] for r in rows] == ["warm", "warm"]
        assert all(0 <= r["data_wait_fraction"] < 1 for r in rows) and "data wait" in proc.stdout
    assert len(list((tmp_path / "cache").glob("*.h5"))) == 2  # one shard per rank, reused by the second job


def test_progress_in_a_log_file_is_plain_lines(tmp_path):
    """stdout and stderr redirected to files, as under sbatch: no tqdm redraws, a line every tenth of an epoch."""
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "jobs.train",
           *[a for a in QUICK if a != "--no-progress"], "--epochs", "2"]
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.run(cmd, stdout=o, stderr=e, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, err.read_text()[-3000:]
    text = out.read_text()
    assert "\r" not in text and "\r" not in err.read_text()
    # 512 samples / (2 ranks x 32) = 8 steps: a line after each of steps 1..7 of each epoch.
    for epoch in (1, 2):
        lines = [line for line in text.splitlines() if line.startswith(f"epoch {epoch}/2: ")]
        assert [line.split()[2] for line in lines] == [f"{n}/8" for n in range(1, 8)], text
        assert all(", loss " in line and line.endswith(" samples/s") for line in lines)


def test_a_failed_metrics_write_stops_every_rank_with_one_line(tmp_path):
    """/dev/full: the path passes the start-up check, the write fails (ENOSPC) on rank 0 alone."""
    cmd = ["timeout", "-k", "5", "120", mpiexec(), "-n", "2", sys.executable, "-m", "jobs.train", *QUICK,
           "--epochs", "1", "--json", "/dev/full"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == ["error: --json: cannot write /dev/full: No space left on device"]


def test_a_data_problem_exits_2_on_every_rank(tmp_path):
    """A dataset directory that passes the start-up check but holds no dataset: one line, no traceback."""
    if not os.path.isdir("/usr/share/datasets/fashion-mnist"):
        pytest.skip("Fashion-MNIST is not installed (make setup installs it as root)")
    (tmp_path / "empty").mkdir()
    cmd = ["timeout", "-k", "5", "120", mpiexec(), "-n", "2", sys.executable, "-m", "jobs.train", "--no-progress",
           "--cache-dir", str(tmp_path / "cache"), "--data-dir", str(tmp_path / "empty")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: ") and "not a recognised dataset layout" in proc.stderr


def test_ranks_that_disagree_about_an_input_all_stop(tmp_path):
    """A relative --data-dir that exists in rank 0's working directory only: every rank stops, none waits."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    (tmp_path / "a" / "data").mkdir()
    job = [sys.executable, "-m", "jobs.train", "--no-progress", "--cache-dir", "cache", "--data-dir", "data"]
    cmd = ["timeout", "-k", "5", "60", mpiexec(), "-n", "1", "-wdir", str(tmp_path / "a"), *job,
           ":", "-n", "1", "-wdir", str(tmp_path / "b"), *job]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == ["error: --data-dir: data does not exist (rank 1)"]



NO_CUDA = "checks what a machine without a CUDA device says"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")


def test_device_cpu_is_the_default_and_is_reported(tmp_path):
    """The header line and the JSON name the device, torch, CUDA and how gradients reach MPI."""
    out = tmp_path / "m.json"
    proc = train(tmp_path, "--strategy", "wfbp", "--epochs", "1", "--max-steps", "2", "--json", str(out))
    device = json.loads(out.read_text())["device"]
    assert device["type"] == "cpu" and len(device["rank_devices"]) == 2
    assert all(d.endswith("/cpu") for d in device["rank_devices"])
    assert device["torch"] == torch.__version__ and device["transport"]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("device "))
    assert f"torch {torch.__version__}" in header and "gradient transport: " in header


@pytest.mark.skipif(torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("job", ["jobs.train", "jobs.bench.strategies_worker"])
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(job):
    """Both ranks check; rank 0 alone says so, naming the torch build: no traceback, no hang."""
    cmd = ["timeout", "-k", "5", "120", mpiexec(), "-n", "2", sys.executable, "-m", job, "--device", "cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: --device: cuda asked, but torch {torch.__version__} sees no CUDA device ("), proc.stderr


def test_device_must_be_cpu_or_cuda():
    proc = subprocess.run([sys.executable, "-m", "jobs.train", *QUICK, "--device", "gpu"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: --device: invalid choice: 'gpu' (choose from 'cpu', 'cuda')"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "p3"])
def test_device_cuda_trains_four_ranks_on_the_gpu(tmp_path, strategy):
    """4 ranks on however many GPUs (sharing them): the JSON says cuda and the loss falls."""
    out = tmp_path / "m.json"
    proc = train(tmp_path, "--device", "cuda", "--strategy", strategy, "--epochs", "2", "--json", str(out), n=4,
                 timeout=300)
    doc = json.loads(out.read_text())
    assert doc["device"]["type"] == "cuda" and doc["device"]["cuda"] == torch.version.cuda
    assert all(d.split("/", 1)[1].startswith("cuda:") for d in doc["device"]["rank_devices"])
    assert doc["device"]["transport"] and "gradient transport: " in proc.stdout
    rows = doc["epochs"]
    assert rows[1]["loss"] < rows[0]["loss"] and all(0 <= r["test_accuracy"] <= 1 for r in rows)
