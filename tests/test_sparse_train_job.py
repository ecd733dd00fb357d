"""jobs.train with a sparse strategy on CUDA: selection on the GPU, pairs through pinned memory, the loss falls."""

from __future__ import annotations

import json

import pytest
import torch
from test_train_job import train

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, granularity", [("topk", "model"), ("topk", "layer"), ("hier-topk", "layer")])
def test_device_cuda_trains_a_sparse_strategy(tmp_path, strategy, granularity):
    """4 ranks sharing the GPU(s), DeviceMSTopK at 10%: the JSON says cuda, the loss falls, the scores are sane."""
    out = tmp_path / "m.json"
    proc = train(tmp_path, "--device", "cuda", "--strategy", strategy, "--density", "0.1", "--topk-granularity",
                 granularity, "--epochs", "2", "--json", str(out), n=4, timeout=300)
    doc = json.loads(out.read_text())
    assert doc["device"]["type"] == "cuda" and all("/cuda:" in d for d in doc["device"]["rank_devices"])
    assert "gradient transport: " in proc.stdout
    rows = doc["epochs"]
    assert rows[1]["loss"] < rows[0]["loss"] and all(0 <= r["test_accuracy"] <= 1 for r in rows)
