"""jobs.train --resume decides once for every rank, also when only rank 0's node holds the checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from mpicomm.launch import mpiexec

QUICK = ["--model", "mlp", "--data", "synthetic", "--synthetic-samples", "512", "--batch-size", "32",
         "--no-progress", "--strategy", "topk", "--density", "0.1", "--dense-warmup-steps", "3",
         "--density-ramp-steps", "5"]

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="node-local directories are emulated with mount namespaces (root)")


def train(*args, timeout=180):
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "jobs.train", *QUICK, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@needs_root
def test_node_local_checkpoint_on_rank_0_only(tmp_path):
    """Each rank gets a private tmpfs at the same path (its node's local disk); only rank 0's holds the file."""
    straight, split, out = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "out.pt"
    train("--epochs", "3", "--checkpoint", str(straight))
    train("--epochs", "2", "--checkpoint", str(split))
    local = "/mnt/mpitrain-node-local"
    job = " ".join([sys.executable, "-m", "jobs.train", *QUICK, "--epochs", "3", "--checkpoint",
                    f"{local}/ckpt.pt", "--resume"])
    script = (f"mkdir -p {local} && mount -t tmpfs tmpfs {local} && "
              f"if [ \"$PMI_RANK\" = 0 ]; then cp {split} {local}/ckpt.pt; fi && {job}; rc=$?; "
              f"if [ \"$PMI_RANK\" = 0 ]; then cp {local}/ckpt.pt {out}; fi; exit $rc")
    cmd = [mpiexec(), "-n", "2", "unshare", "-m", "--propagation", "private", "sh", "-c", script]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "epoch 3: loss" in proc.stdout and "epoch 1:" not in proc.stdout
    a, b = torch.load(straight, weights_only=False), torch.load(out, weights_only=False)
    assert a["epoch"] == b["epoch"] == 2
    for k in a["model"]:
        assert torch.allclose(a["model"][k], b["model"][k], rtol=1e-6, atol=1e-7), k


def test_resume_says_when_it_starts_from_scratch_or_has_nothing_left(tmp_path):
    """A requeued job's first run: --resume finds no file, trains from epoch 1 saying so once, and writes it. A run
    whose checkpoint holds --epochs already (the job had finished) trains nothing and says so once (exit 0)."""
    path, out = tmp_path / "ckpt.pt", tmp_path / "m.json"
    proc = train("--epochs", "1", "--max-steps", "2", "--checkpoint", str(path), "--resume")
    assert proc.stdout.count(f"no checkpoint at {path}: starting from scratch") == 1, proc.stdout
    assert "epoch 1: loss" in proc.stdout and path.exists()
    proc = train("--epochs", "2", "--max-steps", "2", "--checkpoint", str(path), "--resume")
    assert f"resumed from {path} after epoch 1" in proc.stdout and "starting from scratch" not in proc.stdout
    assert "nothing to train" not in proc.stdout
    proc = train("--epochs", "2", "--max-steps", "2", "--checkpoint", str(path), "--resume", "--json", str(out))
    assert proc.stdout.count("--epochs 2: the checkpoint is after epoch 2 already; nothing to train") == 1, \
        proc.stdout
    assert "epoch 3" not in proc.stdout and json.loads(out.read_text())["epochs"] == []
