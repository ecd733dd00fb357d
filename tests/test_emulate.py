"""runtime.emulate: true shapes and dtypes, the real gradient order, fixed gradients, waits, and clear errors."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from runtime.emulate import (EmulationError, ProfileModel, RooflineModel, compute_model, device, device_names,
                             emulate, emulate_optimizer, emulated_loss)
from runtime.emulate import accelerator
from runtime.emulate.clock import Clock
from runtime.emulate.trace import trace
from runtime.sim.profile import Layer, Profile
from runtime.workloads.models import build_model, loss_fn, model_input


@pytest.fixture(autouse=True)
def fresh_accelerator():
    accelerator.deactivate()
    yield
    accelerator.deactivate()


def grad_order(model, inputs, loss):
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: order.append(name))
    loss(model(*inputs)).backward()
    return order


@pytest.mark.parametrize("name", ["mlp", "cnn", "vgg19", "resnet50", "transformer", "char-lstm"])
def test_shapes_dtypes_and_gradient_order_are_the_real_models(name):
    torch.manual_seed(0)
    real = build_model(name)
    inputs, target = model_input(name, 4)
    real_out = real(*inputs)
    real_order = grad_order(real, inputs, lambda out: loss_fn(name)(out, target))

    model = build_model(name)
    before = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    buffers = {n: (b.shape, b.dtype) for n, b in model.named_buffers()}
    emulate(model, "v100", inputs)
    out = model(*inputs)
    assert out.shape == real_out.shape and out.dtype == real_out.dtype
    assert out.untyped_storage().nbytes() <= 8  # no activation memory: one zero, stride 0
    order = grad_order(model, inputs, emulated_loss)
    assert {n: (p.shape, p.dtype) for n, p in model.named_parameters()} == before
    assert {n: (b.shape, b.dtype) for n, b in model.named_buffers()} == buffers
    if name == "char-lstm":  # the CPU's fused LSTM hands its four tensors over in another order than meta's
        module = [n.rsplit(".", 1)[0] for n in order]
        assert module == [n.rsplit(".", 1)[0] for n in real_order]
    else:
        assert order == real_order
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and torch.isfinite(p.grad).all()
        assert p.grad.abs().sum() > 0, f"{n}: an emulated gradient must hold values top-k can select from"


def test_the_same_gradient_every_step_and_no_growth():
    model = build_model("mlp")
    inputs, _ = model_input("mlp", 8)
    emulate(model, "v100", inputs)
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    params = [p.detach().clone() for p in model.parameters()]
    grads = []
    for _ in range(3):
        opt.zero_grad()
        emulated_loss(model(*inputs)).backward()
        opt.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[2]))
    # The update is emulated: the parameters keep their values (only time passes).
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    acc = accelerator.active()
    assert set(acc.describe()["emulated"]) >= {"layers", "optimizer", "zero_grad"}


def test_hooks_and_hybcomm_shapes_see_true_inputs():
    model = build_model("vgg19")
    inputs, _ = model_input("vgg19", 4)
    seen = {}
    emulate(model, "v100", inputs)
    def keep(name):
        def hook(mod, args, out):
            seen.setdefault(name, (tuple(args[0].shape), tuple(out.shape)))
        return hook
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(keep(name))
    model(*inputs)
    assert seen == {"classifier.1": ((4, 512), (4, 4096)), "classifier.3": ((4, 4096), (4, 4096)),
                    "classifier.5": ((4, 4096), (4, 10))}


def test_modelled_times_are_waited_and_accounted():
    model = build_model("mlp", hidden=[256, 256])
    inputs, _ = model_input("mlp", 8)
    cm = RooflineModel(device("v100"))
    n = len(trace(model, inputs).calls)
    # A backward of 0.2 s: longer than a loaded host's first backward (tens of ms here), so one that waited for
    # its time would have to sleep, and the counters below would see it.
    fwd, bwd = 0.002, 0.04
    emulate(model, cm, inputs, times=[(fwd, bwd)] * n)
    acc = accelerator.active()
    t = time.perf_counter()
    loss = emulated_loss(model(*inputs))
    clock = acc.clock
    wakes, waited, forward_end = clock.wakes, clock.waited, clock.deadline
    loss.backward()
    # As a GPU's host, it launched the backward and did not wait for it: its time is queued after the forward's
    # on the stream, and the host slept for none of it (the clock's counters say so, not the wall clock).
    assert (clock.wakes, clock.waited) == (wakes, waited)
    # The first unit (a Flatten of the data) has nothing to differentiate: no backward runs, as on a GPU.
    assert clock.deadline == pytest.approx(forward_end + bwd * (n - 1))
    clock.sync()  # what a GPU's host does to see the backward end
    elapsed = time.perf_counter() - t
    assert acc.seconds["layers"] == pytest.approx(fwd * n + bwd * (n - 1))
    assert elapsed >= fwd * n + bwd * (n - 1)  # a wait never ends before its deadline


def test_the_clock_never_ends_work_early_and_counts_it():
    clock = Clock()
    t = time.perf_counter()
    for _ in range(50):
        clock.run(0.0002)
    assert time.perf_counter() - t >= 50 * 0.0002
    assert clock.busy == pytest.approx(0.01)


def test_work_after_another_streams_starts_when_that_ends_and_the_host_does_not_wait():
    """Clock.after: a stream's next work waits for work on another (a copy back on a side stream), as a CUDA
    stream waits on an event; the call returns at once, and synchronize waits for that work too."""
    clock = Clock()
    t = time.perf_counter()
    clock.after(t + 0.02)
    assert (clock.wakes, clock.waited) == (0, 0.0)  # the host did not sleep for the other stream
    clock.run(0.001, wait=False)
    assert (clock.wakes, clock.waited) == (0, 0.0)
    assert clock.deadline == pytest.approx(t + 0.021)
    assert clock.idle == 0.0  # the stream's first work: no earlier work of its own that the device idled after
    clock.run(0.001, wait=False)  # consumed: the next work follows the last, not the other stream
    assert clock.deadline == pytest.approx(t + 0.022)
    clock.after(clock.deadline + 0.01)
    clock.sync()
    assert time.perf_counter() - t >= 0.032


def test_compute_scale_multiplies_every_time():
    model = build_model("mlp")
    inputs, _ = model_input("mlp", 8)
    emulate(model, "v100", inputs, scale=10.0)
    emulated_loss(model(*inputs)).backward()
    e = model._emulation
    assert accelerator.active().seconds["layers"] == pytest.approx(10 * (e.forward_s + e.backward_s))


def test_named_devices_and_their_errors():
    assert {"h100", "v100", "titanx-maxwell", "p4000", "1080ti"} <= set(device_names())
    assert device("titanx").name == "titanx-maxwell"
    assert device("v100:amp").precision == "amp"
    with pytest.raises(EmulationError, match="unknown device 'k80'.*h100"):
        compute_model("k80")
    with pytest.raises(EmulationError, match="no tf32 rate"):
        device("v100:tf32")


def test_a_single_layer_is_refused_with_what_to_pass_instead():
    """A leaf module calls no module of its own, the units emulation times; the message says to wrap it."""
    with pytest.raises(EmulationError, match=r"Linear is a single layer.*nn.Sequential\(layer\)"):
        emulate(nn.Linear(4, 4), "titanx", (torch.randn(2, 4),))
    model = nn.Sequential(nn.Linear(4, 4))
    emulate(model, "titanx", (torch.randn(2, 4),))  # wrapped, it emulates
    assert model._emulation is not None


def test_one_tensor_is_the_models_one_input_not_its_rows():
    """emulate(model, dev, x): x is the one argument, as torch.jit.trace takes it (its 32 rows, as a tuple, were 32
    arguments: "forward() takes 2 positional arguments but 33 were given")."""
    model, x = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)), torch.randn(32, 20)
    emulate(model, "v100", x)
    assert model(x).shape == (32, 4)


def test_twice_is_refused():
    model = build_model("mlp")
    inputs, _ = model_input("mlp", 2)
    emulate(model, "v100", inputs)
    with pytest.raises(EmulationError, match="emulated already"):
        emulate(model, "v100", inputs)


def test_an_input_of_another_shape_or_dtype_is_refused_naming_both():
    """The units answer with the traced shapes and times: another batch would run on silently at the traced one."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(32, 8)
    emulate(model, "v100", (x,))
    for other, said in [(torch.randn(64, 8), r"\(64, 8\) float32"), (x.double(), r"\(32, 8\) float64")]:
        for grad in (True, False):  # training, and evaluation's forward without a graph
            with torch.set_grad_enabled(grad), pytest.raises(
                    EmulationError, match=rf"Sequential called with input 0 {said}, traced with \(32, 8\) float32"
                                          r".*emulate it again with this input.*drop_last"):
                model(other)
    with pytest.raises(EmulationError, match="called with 2 inputs, traced with 1"):
        model(x, x)
    assert model(x).shape == (32, 4)  # the traced input still runs


def profile_of(model, inputs, **changes) -> Profile:
    layers = [Layer(c.name, 0.001, 0.002, tuple(p.numel() for p in c.params)) for c in trace(model, inputs).calls
              if c.params]
    for name, layer in changes.items():
        layers = [layer if l.name == name else l for l in layers] if layer else [l for l in layers if l.name != name]
    # step_s: what the hooked steps add up to (the layers, the optimizer), as on a device whose syncs cost nothing
    return Profile("mlp", 8, "cuda", tuple(layers), step_s=0.003 * len(layers) + 0.001, optimizer_s=0.001,
                   other_s=0.0)


def test_a_measured_profile_of_a_transformer_with_tied_weights_fits_its_trace():
    """A real profile (runtime.sim.measure) of a model whose output layer shares the target embedding's
    weight, and whose attention units use their out_proj's weights without calling it: every owner the
    profile timed has its times, and they add up to the profile's."""
    from runtime.sim.measure import measure

    torch.manual_seed(0)
    model = build_model("transformer", num_encoder_layers=1, num_decoder_layers=1)
    assert model.out.weight is model.tgt_embed.weight
    inputs, target = model_input("transformer", 4)
    profile = measure(model, inputs, target, loss_fn("transformer"), torch.optim.SGD(model.parameters(), lr=0.1),
                      steps=1, warmup=0, name="transformer", sparse_density=None, gflops=False)
    assert "tgt_embed" in {l.name for l in profile.layers}
    pm = ProfileModel(profile)
    times = pm.unit_times(trace(model, inputs))
    assert sum(f for f, _ in times) == pytest.approx(pm.scale * sum(l.fwd_s for l in profile.layers) + profile.other_s)
    assert sum(b for _, b in times) == pytest.approx(pm.scale * sum(l.bwd_s for l in profile.layers))


def test_a_stage_or_a_layer_finds_its_times_in_a_profile_of_the_whole_model():
    """A pipeline emulates each stage alone, and plans its split from each layer's modelled time; with a
    profile of the whole model (what --take-profile writes) both find their layers' times in it."""
    from runtime.pipeline import as_layers
    from runtime.pipeline.emulation import stage_input
    from runtime.pipeline.partition import modelled_profile
    from runtime.sim.measure import measure

    torch.manual_seed(0)
    model = build_model("mlp", hidden=[64, 32])
    inputs, target = model_input("mlp", 8)
    profile = measure(model, inputs, target, loss_fn("mlp"), torch.optim.SGD(model.parameters(), lr=0.1),
                      steps=1, warmup=0, name="mlp", sparse_density=None, gflops=False)
    pm = ProfileModel(profile)
    layers = as_layers(model)
    per_layer = modelled_profile(layers, inputs[0], pm)
    timed = {l.name: pm.scale * (l.fwd_s + l.bwd_s) for l in profile.layers}
    assert sum(p.seconds for p in per_layer) == pytest.approx(sum(timed.values()) + profile.other_s)
    assert per_layer[-1].seconds == pytest.approx(timed["net.5"])  # the last Linear, by its name in the whole
    half = pm.unit_times(trace(model, model_input("mlp", 4)[0]))  # a micro-batch of half the profile's batch
    whole = pm.unit_times(trace(model, inputs))
    assert [x for t in half for x in t] == pytest.approx([x / 2 for t in whole for x in t])
    stage = nn.Sequential(*layers[3:])  # Linear(64, 32), ReLU, Linear(32, 10): a last stage
    emulate(stage, pm, (stage_input(layers, 3, inputs[0]),))
    assert stage._emulation.backward_s > 0
    with pytest.raises(EmulationError, match="no times for 0"):  # a module of another model is not in it
        ProfileModel(profile).unit_times(trace(nn.Sequential(nn.Linear(4, 4)), (torch.zeros(2, 4),)))


def test_a_profile_s_layers_take_the_plain_step_s_total():
    """The layers are timed in hooked steps that synchronise at every layer; a GPU's plain step is shorter.
    The emulated step takes the plain step's time, the layers keeping their shares."""
    model = build_model("mlp")
    inputs, _ = model_input("mlp", 8)
    hooked = profile_of(model, inputs)
    plain = Profile("mlp", 8, "cuda", hooked.layers, step_s=0.5 * (hooked.step_s - 0.001) + 0.001,
                    optimizer_s=0.001, other_s=0.0)
    a = ProfileModel(hooked).unit_times(trace(model, inputs))
    b = ProfileModel(plain).unit_times(trace(model, inputs))
    assert sum(f + g for f, g in a) == pytest.approx(0.003 * len(hooked.layers))
    assert b == [(f / 2, g / 2) for f, g in a]


def test_a_profile_times_the_owners_and_names_what_does_not_fit(tmp_path):
    model = build_model("mlp")
    inputs, _ = model_input("mlp", 8)
    good = profile_of(model, inputs)
    times = ProfileModel(good).unit_times(trace(model, inputs))
    assert sum(f for f, _ in times) == pytest.approx(0.001 * len(good.layers))
    with pytest.raises(EmulationError, match="not taken from this model: no times for net.3"):
        ProfileModel(profile_of(model, inputs, **{"net.3": None})).unit_times(trace(model, inputs))
    other = build_model("mlp", hidden=[128])
    with pytest.raises(EmulationError, match="not taken from this model: net.1 has parameters"):
        ProfileModel(good).unit_times(trace(other, inputs))
    bad = good.to_json()
    bad["layers"][0]["fwd_s"] = -1.0
    path = tmp_path / "bad.json"
    path.write_text(__import__("json").dumps(bad))
    with pytest.raises(EmulationError, match="negative"):
        compute_model(str(path))
    with pytest.raises(EmulationError, match="cannot read profile"):
        compute_model(str(tmp_path / "missing.json"))


def test_the_paper_models_emulate_at_224_without_activation_memory():
    model = build_model("resnet50-224")
    inputs, _ = model_input("resnet50-224", 2)
    emulate(model, "h100", inputs)
    out = model(*inputs)
    assert out.shape == (2, 1000)
    emulated_loss(out).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_emulation_benchmark_runs_a_profile_on_its_own_model_and_refuses_a_file_that_is_none(tmp_path):
    import json

    from jobs.bench import emulation as bench
    from jobs.common.inputs import InputError

    model = build_model("mlp")
    inputs, _ = model_input("mlp", 8)
    path = tmp_path / "mlp.json"
    path.write_text(json.dumps(profile_of(model, inputs).to_json()))
    out = tmp_path / "rows.json"
    assert bench.main(["--models", "cnn", "--devices", "v100", "--profiles", str(path), "--no-hooked", "--steps",
                       "2", "--warmup", "1", "--waits", "10", "--repeats", "1", "--json", str(out)]) == 0
    steps = [r for r in json.loads(out.read_text())["rows"] if r["table"] == "steps"]
    assert [r["model"] for r in steps] == ["cnn", "mlp"] and "mlp.json" in steps[1]["device"]
    (tmp_path / "not.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="--profiles: .*not.json: not a profile"):
        bench._profile_model(str(tmp_path / "not.json"))
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--profiles", str(tmp_path / "not.json")])
    assert exit_.value.code == 2


def test_a_timed_window_reads_the_device_s_timeline_not_a_late_host_s():
    """A step queues its backward without waiting (as a GPU's host does); when the host is descheduled after the
    lead-in step (several ranks a core), its clock opens the window after the queued work has drained, and a
    window of host time would miss that part of a period. Read on the device's timeline it holds one period."""
    from mpi4py import MPI

    from jobs.bench.strategies_worker import timed_batches
    from jobs.common.compute import Compute

    acc = accelerator.activate(accelerator.Accelerator(compute_model("v100")))
    calls = []

    def step():
        acc.clock.begin()  # a forward starts a pass, as the emulated model's does
        acc.run("forward", 0.02)
        acc.run("backward", 0.06, wait=False)
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.08)  # the lead-in's host, late: the queued backward ends meanwhile

    per_step = timed_batches(MPI.COMM_SELF, step, accelerator.synchronize, 0, 1, 1, Compute("emulated:v100").now)[0]
    assert per_step >= 0.08  # one period of 20 + 60 ms; the host's clock read the forward's 20 ms
    assert per_step < 0.08 + 0.05
