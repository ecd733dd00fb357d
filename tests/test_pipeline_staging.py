"""The staged transport's pieces without MPI: the copier, the stage's device, the partitioner's timing on a device."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from runtime.pipeline import profile_layers
from runtime.pipeline.staging import stage_device
from runtime.pipeline.staging import DONE, Copier

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")


def test_the_cpu_copier_copies_at_once_into_a_separate_buffer_and_every_event_is_complete():
    c = Copier(torch.device("cpu"))
    src = torch.arange(6.0, requires_grad=True) * 2  # part of a graph: the copy must not join it
    host = c.host(((6,), torch.float32))
    event = c.event()
    c.mark(event)
    c.copy(host, src, event, event)
    c.wait(event)
    assert event is DONE and event.query() and torch.equal(host, src.detach())
    assert host.data_ptr() != src.data_ptr() and not host.requires_grad and not host.is_pinned()
    leaf = torch.zeros(6, requires_grad=True)  # a received activation the engine made a leaf
    c.copy(leaf, host, DONE, DONE)
    assert torch.equal(leaf.detach(), host) and leaf.requires_grad


def test_stage_device_names_what_it_cannot_use():
    assert stage_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be one of \\('cpu', 'cuda'\\), got 'tpu'"):
        stage_device("tpu", 0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            stage_device("cuda", 0)


def layers():
    torch.manual_seed(0)
    return [nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5)]


def test_profile_on_the_cpu_measures_every_layer():
    profile = profile_layers(layers(), torch.randn(4, 12), repeats=2, device="cpu")
    assert [p.out_bytes for p in profile] == [4 * 16 * 4, 4 * 16 * 4, 4 * 5 * 4]
    assert all(p.seconds > 0 for p in profile)


@pytest.mark.gpu
@needs_cuda
def test_cuda_copier_and_profile_leave_the_callers_layers_where_they_are():
    device = stage_device("cuda", 0)
    c = Copier(device)
    src = torch.randn(1000, device=device)
    host, done, after = c.host(((1000,), torch.float32)), c.event(), c.event()
    c.mark(after)
    c.copy(host, src, after, done)
    done.synchronize()
    assert host.is_pinned() and torch.equal(host, src.cpu())
    back = torch.empty(1000, device=device)
    c.copy(back, host, done, after)
    c.wait(after)
    assert torch.equal(back, src)
    model = layers()
    profile = profile_layers(model, torch.randn(4, 12), device=device)
    assert len(profile) == 3 and all(p.seconds > 0 for p in profile)
    assert all(p.device.type == "cpu" for m in model for p in m.parameters())
