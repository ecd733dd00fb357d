"""Pipeline(compute=...) on 4 ranks: each stage emulated alone at its input's shape, the true bytes on the wire."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

from conftest import assert_everywhere
from runtime.pipeline import MODES, Pipeline, PipelineError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

WIDTHS = [12, 16, 16, 16, 16, 12, 12, 5]  # each layer's input, then the last one's output
BALANCE = [2, 2, 2, 1]
BATCH, MICRO = 16, 4


@pytest.fixture(autouse=True)
def no_accelerator_left():
    """An emulated accelerator is the process's: the tests after these must compute for real."""
    from runtime.emulate.accelerator import deactivate

    yield
    deactivate()


def build(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 12), nn.Tanh(),
                         nn.Linear(12, 5))


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 12, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def pipeline(mode, say=None, **kw):
    x, _ = batch()
    kw.setdefault("balance", BALANCE)
    return Pipeline(build(), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), loss_fn=F.cross_entropy,
                    microbatches=BATCH // MICRO, mode=mode, sample=x[:MICRO], compute="v100", say=say, **kw)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_trains_emulated_stages_and_sends_the_true_bytes(mode):
    from runtime.emulate import active

    x, y = batch()
    with pipeline(mode) as pipe:
        start = [p.detach().clone() for p in pipe.params]
        a = pipe.layer_range.start
        # Each stage's module is emulated at its own input: the micro-batch, or the previous stage's output.
        emu = pipe.module._emulation
        assert emu.steps[0].call.inputs[0].shape == (MICRO, WIDTHS[a])
        assert emu.output.shape == (MICRO, WIDTHS[pipe.layer_range.stop])
        losses = [pipe.train_step(x, y) for _ in range(2)]
        pipe.drain()
        stats = pipe.stats()
        # Nothing was computed: the emulated optimizer waits instead of updating.
        assert all(torch.equal(p, s) for p, s in zip(pipe.params, start))
        assert losses == ([0.0, 0.0] if pipe.last else [None, None])
        acc = active()
        assert acc is not None and acc.seconds["layers"] > 0 and acc.seconds["optimizer"] > 0
        if mode == "stash" and not pipe.last:  # weight copies: modelled, never made
            assert acc.seconds["weight versions"] > 0
            assert stats["weight_copy_bytes"] == pipe.in_flight * stats["parameter_bytes"]
    # Every micro-batch's activation forward and its gradient back, at the true sizes (float32).
    k = pipe.stage
    per_micro = 4 * MICRO * ((WIDTHS[sum(BALANCE[:k + 1])] if k < 3 else 0) + (WIDTHS[sum(BALANCE[:k])] if k else 0))
    assert stats["bytes_sent"] == 2 * (BATCH // MICRO) * per_micro


def test_host_staged_links_send_the_true_bytes_too():
    """The staged transport (a GPU's, forced on the CPU) copies the zero-stride outputs into its host buffers."""
    x, y = batch()
    with pipeline("vanilla", staging=True) as pipe:
        pipe.train_step(x, y)
        pipe.drain()
        sent = pipe.stats()["bytes_sent"]
    k = pipe.stage
    per_micro = 4 * MICRO * ((WIDTHS[sum(BALANCE[:k + 1])] if k < 3 else 0) + (WIDTHS[sum(BALANCE[:k])] if k else 0))
    assert sent == (BATCH // MICRO) * per_micro


@pytest.mark.parametrize("staging", [False, True])
def test_each_send_records_how_long_it_held_the_host(staging):
    """send_times: one host time per message, by direction (what the simulator draws); clear starts anew."""
    x, y = batch()
    with pipeline("vanilla", staging=staging) as pipe:
        pipe.train_step(x, y)
        pipe.drain()
        times, messages = pipe.send_times(clear=True), pipe.stats()["messages_sent"]
        after = pipe.send_times()
    micro = BATCH // MICRO
    want = {"act": micro if not pipe.last else 0, "grad": micro if pipe.stage else 0}
    ok = ({k: len(v) for k, v in times.items()} == want and messages == sum(want.values())
          and all(0 <= t < 5 for v in times.values() for t in v) and after == {"act": [], "grad": []})
    assert_everywhere(MPI.COMM_WORLD, ok, f"stage {pipe.stage}: {times}, {messages} messages, then {after}")


def test_each_op_records_its_hosts_work_beyond_the_devices_sleeps():
    """op_times: one host time per forward, backward and update (vanilla: an update a micro-batch), without what
    the thread slept for the emulated device, so never more than the op's span; clear starts anew."""
    from runtime.trace.timeline import Timeline

    x, y = batch()
    tl = Timeline(MPI.COMM_WORLD.Get_rank())
    with pipeline("vanilla", timeline=tl) as pipe:
        pipe.train_step(x, y)
        pipe.drain()
        times, after = pipe.op_times(clear=True), pipe.op_times()
    spans = {e["name"]: e["dur"] / 1e6 for e in tl.to_trace()["traceEvents"] if e.get("ph") == "X"}
    micro = BATCH // MICRO
    counts = {k: len(v) for k, v in times.items()}
    within = all(t <= spans[f"{k}{i}"] + 1e-4 for k in "FB" for i, t in enumerate(times[k]))
    ok = counts == {"F": micro, "B": micro, "U": micro} and within and all(t >= 0 for v in times.values() for t in v) \
        and after == {"F": [], "B": [], "U": []}
    assert_everywhere(MPI.COMM_WORLD, ok, f"stage {pipe.stage}: {counts}, {times}, spans {spans}, then {after}")


def test_automatic_partition_uses_the_modelled_layer_times():
    said = []
    with pipeline("flush", balance=None, stages=4, say=said.append) as pipe:
        pipe.train_step(*batch())
    assert sum(pipe.balance) == 7 and len(pipe.balance) == 4
    assert_everywhere(MPI.COMM_WORLD, MPI.COMM_WORLD.allgather(pipe.balance) == [pipe.balance] * 4)
    if MPI.COMM_WORLD.Get_rank() == 0:  # the plan's table: the modelled times, not the CPU's
        assert "| 0 | 0:Linear" in said[0]


def test_emulated_compute_needs_a_sample_on_every_rank():
    with pytest.raises(PipelineError, match="sample="):
        Pipeline(build(), lambda ps: torch.optim.SGD(ps, lr=0.05), loss_fn=F.cross_entropy, balance=BALANCE,
                 compute="v100", say=None)


def test_an_unknown_device_stops_every_rank():
    with pytest.raises(PipelineError, match="unknown device 'v99'"):
        Pipeline(build(), lambda ps: torch.optim.SGD(ps, lr=0.05), loss_fn=F.cross_entropy, balance=BALANCE,
                 sample=batch()[0][:MICRO], compute="v99", say=None)


def test_an_emulated_stage_refuses_inputs_of_another_shape():
    from runtime.pipeline.emulation import emulate_stage

    layers = list(build())
    stage = nn.Sequential(*layers[2:4])
    emulate_stage(MPI.COMM_SELF, 1, stage, layers, 2, torch.zeros(MICRO, 12), "v100")
    assert stage(torch.zeros(MICRO, 16)).shape == (MICRO, 16)
    with pytest.raises(ValueError, match=r"emulated for inputs \(4, 16\) float32, got \(8, 16\)"):
        stage(torch.zeros(8, 16))
