"""runtime.emulate.sim_profile: the simulator's profile of a compute model times what emulate() waits, per layer."""

from __future__ import annotations

import pytest
import torch

from emulate_helpers import fresh_accelerator  # noqa: F401 - autouse fixture
from runtime.emulate import EmulationError, accelerator, compute_model, emulate
from runtime.emulate.sim_profile import modelled_profile
from runtime.sim import simulate
from runtime.sim.cluster import Cluster
from runtime.sim.profile import Profile
from runtime.workloads.models import build_model, model_input


def emulated_seconds(name: str, compute, batch: int) -> float:
    """The forward and backward seconds emulate() queues for one step of `name`."""
    accelerator.deactivate()
    model = build_model(name)
    inputs, _ = model_input(name, batch)
    emu = emulate(model, compute, inputs)._emulation
    accelerator.deactivate()
    return emu.forward_s + emu.backward_s


@pytest.mark.parametrize("name", ["vgg19", "resnet50", "transformer"])
def test_a_modelled_profile_times_every_unit_emulate_waits_and_owns_every_parameter(name):
    model = build_model(name)
    inputs, _ = model_input(name, 4)
    prof = modelled_profile(model, "v100", inputs, name)
    cm = compute_model("v100")
    memset = cm.memset_s(4 * sum(p.numel() for p in model.parameters()))
    layers = sum(l.fwd_s + l.bwd_s for l in prof.layers)
    assert layers + prof.other_s - memset == pytest.approx(emulated_seconds(name, "v100", 4), rel=1e-9)
    assert prof.grad_bytes == 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = [p for p in model.parameters() if p.requires_grad]
    assert prof.optimizer_s == pytest.approx(cm.optimizer_s(sum(p.numel() for p in params), len(params), 1))
    assert prof.step_s == pytest.approx(layers + prof.optimizer_s + prof.other_s)
    assert prof.batch_size == 4 and prof.device == "cuda" and prof.select_s_per_element > 0 and prof.gflops > 0
    assert all(l.fwd_s > 0 and l.bwd_s > 0 and l.act_bytes > 0 for l in prof.layers)


def test_linear_layers_carry_their_shapes_and_a_scale_slows_every_time():
    model = build_model("vgg19")
    inputs, _ = model_input("vgg19", 8)
    prof = modelled_profile(model, "p4000", inputs, "vgg19")
    fcs = [l.linear for l in prof.layers if l.linear]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert fcs == [(m.in_features, m.out_features, 8, True) for m in linears] and len(fcs) == 3
    assert len(prof.layers) == 16 + 3  # the convolutions and the FC layers: the units that own parameters
    slow = modelled_profile(model, "p4000", inputs, "vgg19", scale=10)
    assert slow.step_s == pytest.approx(10 * prof.step_s) and slow.gflops == pytest.approx(prof.gflops / 10)
    assert [l.params for l in slow.layers] == [l.params for l in prof.layers]
    adam = modelled_profile(model, "p4000", inputs, "vgg19", optimizer_state=2)
    assert adam.optimizer_s > prof.optimizer_s
    with pytest.raises(EmulationError, match="positive"):
        modelled_profile(model, "p4000", inputs, "vgg19", scale=0)


def test_the_profile_saved_and_emulated_again_waits_the_same_step(tmp_path):
    """Round trip: a modelled profile, as emulated:PROFILE.json, queues the same seconds as the device it came from."""
    model = build_model("resnet50")
    inputs, _ = model_input("resnet50", 4)
    prof = modelled_profile(model, "h100", inputs, "resnet50")
    path = tmp_path / "r50.json"
    prof.save(str(path))
    again = Profile.load(str(path))
    assert again == prof
    assert emulated_seconds("resnet50", str(path), 4) == pytest.approx(prof.step_s - prof.optimizer_s, rel=1e-9)


def test_the_simulator_runs_a_modelled_profile_on_gpus_and_its_compute_is_the_models():
    model = build_model("resnet50-224")
    inputs, _ = model_input("resnet50-224", 8)
    prof = modelled_profile(model, "v100", inputs, "resnet50-224")
    cluster = Cluster(nodes=4, ranks_per_node=1, bandwidth=1e9, device="gpu")
    alone = simulate(prof, cluster, "compute").t_iter_s
    assert alone == pytest.approx(prof.compute_s, rel=0.02)
    # 102 MB of gradients over 1 Gbit/s take longer than the V100's 0.03 s step: the ring is slower than compute.
    assert simulate(prof, cluster, "allreduce").t_iter_s > 5 * alone


def test_a_model_without_trainable_parameters_is_refused():
    model = torch.nn.Sequential(torch.nn.ReLU())
    with pytest.raises(EmulationError, match="no unit with parameters"):
        modelled_profile(model, "v100", (torch.zeros(2, 3),), "relu")
