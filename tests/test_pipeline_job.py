"""jobs.train --parallel pipeline under mpiexec: metrics, trace, per-stage checkpoints and resume; a killed rank; bad input."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import ROOT, exit_in_process
from mpicomm.launch import mpiexec

QUICK = ["--model", "mlp", "--data", "synthetic", "--synthetic-samples", "512", "--batch-size", "32",
         "--microbatches", "4", "--no-progress", "--parallel", "pipeline", "--lr", "0.01"]


def train(*args, n=4, timeout=180):
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "jobs.train", *QUICK, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def one_process(epochs: int):
    """jobs.train's flush run as one process does it: the same model, batches and SGD (QUICK's settings)."""
    import torch.nn.functional as F

    from runtime.workloads.data import BatchPlan
    from runtime.workloads.models import build_model, model_input

    (x,), y = model_input("mlp", 512, 0)
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    plan = BatchPlan(512, 32, 1, 0, 0)
    for epoch in range(epochs):
        for idx in plan.epoch(epoch):
            idx = torch.as_tensor(idx)
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model


@pytest.mark.timeout(300)  # two 4-rank jobs
def test_trains_with_metrics_trace_checkpoints_and_resumes_equal_to_one_process(tmp_path):
    """flush is synchronous SGD: after 1 epoch, a checkpoint and --resume for the second, equal to one process."""
    out, trace, ckpt = tmp_path / "m.json", tmp_path / "trace.json", tmp_path / "ckpt"
    proc = train("--epochs", "1", "--json", str(out), "--timeline", str(trace), "--checkpoint", str(ckpt))
    saved = json.loads(out.read_text())
    assert saved["parallel"] == "pipeline" and sum(saved["balance"]) == 4 and len(saved["balance"]) == 4
    row, = saved["epochs"]
    assert 0 <= row["test_accuracy"] <= 1 and row["samples_per_s"] > 0 and row["stage_bytes_sent"] > 0
    assert "| stage |" in proc.stdout  # the partition plan
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = {(e["pid"], e["name"]) for e in events if e.get("ph") == "X"}
    for stage in range(4):  # forward and backward of micro-batch 0 on every stage, in one trace
        assert (stage, "F0") in spans and (stage, "B0") in spans, sorted(spans)[:10]

    proc = train("--epochs", "2", "--checkpoint", str(ckpt), "--resume", "--json", str(out))
    assert "resumed from" in proc.stdout and "epoch 2: loss" in proc.stdout and "epoch 1:" not in proc.stdout
    assert json.loads(out.read_text())["epochs"][0]["loss"] < row["loss"]
    reference = list(one_process(2).net)
    for stage in range(4):
        saved = torch.load(f"{ckpt}.stage{stage}-of-4", weights_only=False)
        assert saved["epoch"] == 1
        module = saved["stage"]["module"]
        layer = reference[stage]  # balance [1, 1, 1, 1]: stage k is layer k
        for name, value in layer.state_dict().items():
            assert torch.allclose(module[f"0.{name}"], value, rtol=1e-5, atol=1e-6), (stage, name)


KILLED = textwrap.dedent("""
    import os, signal, torch, torch.nn as nn, torch.nn.functional as F
    from mpi4py import MPI
    from runtime.pipeline import Pipeline
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    pipe = Pipeline(model, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), loss_fn=F.mse_loss,
                    balance=[1, 1, 1, 1], microbatches=4, mode="vanilla")
    for step in range(1000):
        if step == 3 and MPI.COMM_WORLD.Get_rank() == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        pipe.train_step(torch.randn(8, 16), torch.randn(8, 16))
""")


def test_a_rank_killed_mid_pipeline_ends_the_job_non_zero_within_30_s(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    start = time.monotonic()
    proc = subprocess.run([mpiexec(), "-n", "4", sys.executable, str(script)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert elapsed < 30, f"took {elapsed:.0f} s"


@pytest.mark.parametrize("args,option", [
    (["--pipeline-mode", "stash"], "--pipeline-mode: needs --parallel pipeline"),
    (["--parallel", "pipeline", "--model", "resnet50", "--data", "synthetic"], "--model: resnet50 is not sequential"),
    (["--parallel", "pipeline", "--microbatches", "5"], "--microbatches: 5 does not divide --batch-size 64"),
    (["--parallel", "pipeline", "--stages", "3"], "--stages: 1 ranks cannot run 3 stages x 1 replicas"),
    (["--parallel", "pipeline", "--balance", "2,x"], "--balance: must be positive layer counts"),
    (["--data", "austen"], "--data: austen is a character corpus: use it with --model char-lstm"),
    (["--parallel", "pipeline", "--pipeline-mode", "spectrain", "--optimizer", "adam"],
     "--optimizer: spectrain predicts weights from SGD's momentum"),
    (["--parallel", "pipeline", "--pipeline-mode", "spectrain", "--momentum", "0"],
     "--momentum: spectrain predicts weights from SGD's momentum"),
])
def test_bad_pipeline_input_is_one_line_and_exit_2(args, option):
    proc = subprocess.run([sys.executable, "-m", "jobs.train", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {option}"), proc.stderr


@pytest.mark.timeout(240)  # four short 2-rank jobs
def test_a_balance_or_a_resume_that_cannot_be_used_is_one_line_and_exit_2(tmp_path):
    """Found once the pipeline is built (the model's layers) or its stages' checkpoints read: raised on every rank
    together, said once by rank 0, exit 2 everywhere (each rank's traceback and exit 1 before)."""
    def run(*args):
        cmd = ["timeout", "-k", "5", "100", mpiexec(), "-n", "2", sys.executable, "-m", "jobs.train", *QUICK,
               "--epochs", "2", "--max-steps", "2", *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)

    proc = run("--balance", "99,1")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: --balance: balance [99, 1] covers 100 layers, the model has 4"], proc.stderr[-3000:]
    ckpt = tmp_path / "pk.pt"
    proc = run("--epochs", "1", "--checkpoint", str(ckpt))
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = f"{ckpt}.stage0-of-2"
    saved = torch.load(first, weights_only=False)
    torch.save(dict(saved, epoch=4), first)  # stage 0 after epoch 5, stage 1 after epoch 1
    proc = run("--checkpoint", str(ckpt), "--resume")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: --resume: stage checkpoints of different epochs: [5, 1]"], proc.stderr[-3000:]
    os.remove(f"{ckpt}.stage1-of-2")
    proc = run("--checkpoint", str(ckpt), "--resume")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: --resume: rank 1: {ckpt}.stage1-of-2 is missing (other stages have theirs)"], proc.stderr[-3000:]


# Appended to the README's program: each rank saves what its stage holds, to compare with the gathered model.
STAGE_FILES = textwrap.dedent("""
    torch.save(dict(pipe.state_dict(), replica=pipe.replica), f"stage{pipe.stage}-replica{pipe.replica}.pt")
""")


@pytest.mark.timeout(300)
def test_the_readme_pipeline_program_learns_and_gathers_the_stages(tmp_path):
    """2 stages x 2 replicas as printed: it learns, rank 0 prints the plan, cnn.pt is every stage's weights."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("## Pipeline model parallelism"):]
    script = tmp_path / "prog.py"
    script.write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1) + STAGE_FILES)
    proc = subprocess.run([mpiexec(), "-n", "4", sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("| stage |") == 1, proc.stdout  # the plan, once (rank 0)
    lines = re.findall(r"replica (\d), epoch (\d): loss [0-9.]+, accuracy ([0-9.]+)", proc.stdout)
    assert sorted((r, e) for r, e, _ in lines) == [("0", "1"), ("0", "2"), ("1", "1"), ("1", "2")], proc.stdout
    assert all(float(a) > 0.8 for r, e, a in lines if e == "2"), proc.stdout
    gathered = torch.load(tmp_path / "cnn.pt")
    covered = set()
    for path in tmp_path.glob("stage*-replica*.pt"):
        stage = torch.load(path, weights_only=False)
        a, b = stage["layers"]
        assert stage["balance"][stage["stage"]] == b - a
        for key, value in stage["module"].items():
            j, name = key.split(".", 1)
            assert torch.equal(gathered[f"{a + int(j)}.{name}"], value), (path.name, key)
            covered.add(f"{a + int(j)}.{name}")
    assert len(list(tmp_path.glob("stage*-replica*.pt"))) == 4 and covered == set(gathered)


def test_a_diverging_run_says_so_on_every_rank_and_exits_3():
    """--lr far too large: the loss explodes; each rank prints one line naming the step and the loss."""
    cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "jobs.train", *QUICK, "--pipeline-mode", "spectrain",
           "--lr", "1e4", "--epochs", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    said = re.findall(r"error: rank (\d): training diverged at step (\d+) \(micro-batch \d\): loss (\S+) is "
                      r"(?:not finite|over 100 x)", proc.stderr)
    assert sorted(rank for rank, _, _ in said) == ["0", "1", "2", "3"], proc.stderr
    assert len({(step, loss) for _, step, loss in said}) == 1, proc.stderr  # the same step and loss everywhere
    assert "epoch 1: loss" not in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine where torch sees no CUDA device")
@pytest.mark.parametrize("job,args", [
    ("jobs.train", ["--parallel", "pipeline", "--device", "cuda"]),  # as a user runs it; the others in-process
    ("jobs.bench.pipeline_worker", ["--model", "mlp", "--device", "cuda"]),
    ("jobs.bench.pipeline", ["--local", "--models", "mlp", "--device", "cuda"]),
])
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(job, args, capsys):
    if job == "jobs.train":
        proc = subprocess.run([sys.executable, "-m", job, *args], capture_output=True, text=True, cwd=ROOT,
                              timeout=60)
        code, err = proc.returncode, proc.stderr
    else:
        code, _, err = exit_in_process(importlib.import_module(job).parse_args, args, capsys)
    assert code == 2, err
    assert re.match(r"error: --device: cuda asked, but torch \S+ sees no CUDA device", err), err
    assert len(err.strip().splitlines()) == 1, err


def test_device_cuda_leaves_torch_1f1b_out_of_the_benchmark_or_refuses_it(capsys):
    from jobs.bench import pipeline_worker as worker

    code, _, err = exit_in_process(worker.parse_args, ["--model", "mlp", "--device", "cuda", "--contenders",
                                                       "flush,torch-1f1b"], capsys)
    assert code == 2 and err.startswith("error: --contenders: torch-1f1b sends CPU tensors"), err
    args = worker.parse_args(["--model", "mlp"])
    assert "torch-1f1b" in args.contenders and args.device == "cpu"
