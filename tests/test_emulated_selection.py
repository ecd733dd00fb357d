"""Top-k under emulated compute: k pairs of the fixed gradient's largest entries, the device's time waited."""

from __future__ import annotations

import torch

from runtime.emulate import Accelerator, compute_model
from runtime.sparse import emulated
from runtime.sparse.emulated import EmulatedSelection, largest_first
from runtime.sparse.selection import exact_topk, k_for_density


def test_selects_what_exact_topk_selects_and_waits_the_device():
    acc = Accelerator(compute_model("v100"))
    sel = EmulatedSelection(acc)
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    values, indices = sel.select("model", x, 0.01)
    k = k_for_density(x.numel(), 0.01)
    assert indices.numel() == values.numel() == k
    assert set(indices.tolist()) == set(exact_topk(x, k)[1].tolist())
    assert torch.equal(values, x[indices])
    assert acc.calls["select"] == 1 and acc.calls["d2h"] == 1 and acc.seconds["select"] > 0
    # Later steps: the same positions (the gradient is the same), the current values there.
    y = x * 2
    v2, i2 = sel.select("model", y, 0.01)
    assert torch.equal(i2, indices) and torch.equal(v2, y[indices])
    # A density ramp's smaller k is a prefix of the sorted positions; a larger one is found afresh.
    assert torch.equal(sel.select("model", x, 0.005)[1], indices[:k_for_density(x.numel(), 0.005)])
    _, more = sel.select("model", x, 0.02)
    assert set(more.tolist()) == set(exact_topk(x, k_for_density(x.numel(), 0.02))[1].tolist())
    # A node shard coming from the host: its copy to the device is waited first.
    sel.select("shard", x[:5000], 0.01, from_host=True)
    assert acc.calls["h2d"] == 1


def test_largest_first_in_pieces_is_torch_topk_sorted(monkeypatch):
    monkeypatch.setattr(emulated, "CHUNK", 1000)  # 10 pieces, the last one short
    x = torch.randn(9_500, generator=torch.Generator().manual_seed(1))
    for k in (1, 7, 999, 1000, 2500):
        assert torch.equal(largest_first(x, k), torch.topk(x.abs(), k, sorted=True).indices), k
