"""The benchmark models: exact sizes, shapes, gradients, the tied weight, determinism, hook coverage."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from datacache.idx import FASHION_ROOT, load_fashion_mnist
from runtime.workloads.data import BatchPlan, to_tensor
from runtime.workloads.models import MODELS, PAPER_MODELS, build_model, input_shape, loss_fn, model_input

torch.set_num_threads(1)

# Exact parameter counts with the defaults (10 classes, 3 input channels, vocab 1000).
PARAM_COUNTS = {
    "mlp": 203_530,          # 784*256+256 + 256*10+10
    "cnn": 20_522,           # 1*8*25+8 + 8*16*25+16 + 256*64+64 + 64*10+10
    "vgg19": 38_947_914,     # 20,024,384 conv + 18,923,530 classifier
    "resnet50": 23_520_842,
    "transformer": 6_043_624,  # tied: the 256,000-value output weight is the target embedding
    "char-lstm": 5_442_209,  # 97*64 embedding, LSTMs 64->512, 512->512 x2, 512*97+97 head
    "vgg19-22k": 128_389_521,  # 20,024,384 conv + 2,101,248 + 16,781,312 + 89,482,577 (4096 x 21,841 head)
}
# fc-heavy's 208 M parameters are too many to build here over and over: tests/test_sequential_models.py
# counts them on the meta device and trains narrow copies. The paper-size models (up to 229 M parameters,
# 224x224 inputs) would take minutes of CPU here: tests/test_paper_models.py checks them on the meta device.
BUILT = tuple(name for name in MODELS if name != "fc-heavy" and name not in PAPER_MODELS)


def build(name, seed=0, **kw):
    torch.manual_seed(seed)
    return build_model(name, **kw)


@pytest.fixture(scope="module", params=BUILT)
def named_model(request):
    return request.param, build(request.param)


def test_parameter_counts(named_model):
    name, model = named_model
    assert sum(p.numel() for p in model.parameters()) == PARAM_COUNTS[name]
    assert not any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters())


def test_forward_shapes_and_backward_reaches_every_parameter(named_model):
    name, model = named_model
    model.zero_grad(set_to_none=True)
    inputs, target = model_input(name, 2, seed=1)
    out = model(*inputs)
    expected = {"transformer": (2, 16, 1000), "char-lstm": (2, 64, 97), "vgg19-22k": (2, 21841)}.get(name, (2, 10))
    assert out.shape == expected and out.dtype == torch.float32
    loss = loss_fn(name)(out, target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_every_parameter_is_used_under_a_module_whose_pre_hook_fires(named_model):
    """A runtime that waits for parameters in forward pre-hooks must hook a module that runs.

    nn.MultiheadAttention reads out_proj.weight functionally, so out_proj itself never runs;
    its parent (the attention module) does. Every parameter has such an owner or ancestor.
    """
    name, model = named_model
    fired = set()
    handles = [m.register_forward_pre_hook(lambda m, args, n=n: fired.add(n)) for n, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(*model_input(name, 2, seed=0)[0])
    finally:
        for h in handles:
            h.remove()
    for pname, _ in model.named_parameters():
        parts = pname.split(".")[:-1]  # the owning module's path, e.g. ["net", "1"]
        owner_and_ancestors = [".".join(parts[:k]) for k in range(len(parts), 0, -1)]  # root excluded
        assert any(m in fired for m in owner_and_ancestors), pname
    if name == "transformer":
        assert "transformer.encoder.layers.0.self_attn" in fired
        assert "transformer.encoder.layers.0.self_attn.out_proj" not in fired


@pytest.mark.parametrize("name", BUILT)
def test_same_seed_same_parameters(name):
    a, b, c = build(name, seed=5), build(name, seed=5), build(name, seed=6)
    pa, pb, pc = (list(m.state_dict().items()) for m in (a, b, c))
    assert [k for k, _ in pa] == [k for k, _ in pb]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(pa, pb))
    assert not all(torch.equal(x, y) for (_, x), (_, y) in zip(pa, pc))


def test_tied_weight_is_one_parameter_in_two_modules():
    model = build("transformer")
    assert model.out.weight is model.tgt_embed.weight
    assert isinstance(model.out.weight, nn.Parameter)
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is model.out.weight]
    assert sorted(names) == ["out.weight", "tgt_embed.weight"]
    assert sum(p is model.out.weight for p in model.parameters()) == 1  # listed once
    # Its gradient is the sum of both uses: compare with an untied copy holding the same values.
    untied = build("transformer", tie_weights=False)
    assert sum(p.numel() for p in untied.parameters()) == PARAM_COUNTS["transformer"] + 256 * 1000
    untied.load_state_dict(model.state_dict())
    inputs, target = model_input("transformer", 2, seed=3)
    for m in (model, untied):
        loss_fn("transformer")(m(*inputs), target).backward()
    assert torch.allclose(model.out.weight.grad, untied.out.weight.grad + untied.tgt_embed.weight.grad, atol=1e-6)
    # A gradient hook on the shared parameter fires once per backward, with the summed gradient.
    calls = []
    model.out.weight.register_hook(lambda g: calls.append(g.clone()))
    model.zero_grad(set_to_none=True)
    loss_fn("transformer")(model(*inputs), target).backward()
    assert len(calls) == 1 and torch.allclose(calls[0], model.out.weight.grad)


def test_decoder_is_causal():
    model = build("transformer").eval()
    (src, tgt_in), _ = model_input("transformer", 2, seed=0)
    changed = tgt_in.clone()
    changed[:, 10:] = 7
    with torch.no_grad():
        a, b = model(src, tgt_in), model(src, changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-5)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_model_inputs():
    (x,), y = model_input("mlp", 4, seed=0)
    assert x.shape == (4, 784) and y.shape == (4,) and y.dtype == torch.int64
    (x,), y = model_input("resnet50", 2, seed=0, in_channels=1, num_classes=5)
    assert x.shape == (2, 1, 32, 32) and y.max() < 5
    (src, tgt_in), tgt_out = model_input("transformer", 3, seed=0, src_len=6, tgt_len=6, vocab=50)
    assert src.shape == tgt_in.shape == tgt_out.shape == (3, 6)
    assert torch.equal(tgt_in[:, 1:], tgt_out[:, :-1]) and torch.equal(tgt_out, src.flip(1))
    again = model_input("transformer", 3, seed=0, src_len=6, tgt_len=6, vocab=50)
    assert torch.equal(again[0][0], src) and torch.equal(again[1], tgt_out)
    assert input_shape("vgg19", 1) == (1, 32, 32) and input_shape("mlp") == (784,)


def test_options_and_errors():
    mlp = build("mlp", hidden=[128, 64], num_classes=3)
    assert [m.out_features for m in mlp.modules() if isinstance(m, nn.Linear)] == [128, 64, 3]
    assert mlp(torch.zeros(2, 1, 28, 28)).shape == (2, 3)  # flattens image-shaped input too
    vgg = build("vgg19", in_channels=1, dropout=0.5, batch_norm=True)
    kinds = {type(m) for m in vgg.modules()}
    assert nn.Dropout in kinds and nn.BatchNorm2d in kinds
    assert sum(isinstance(m, nn.Conv2d) for m in vgg.modules()) == 16
    assert sum(isinstance(m, nn.Conv2d) for m in build("resnet50").modules()) == 1 + 16 * 3 + 4
    with pytest.raises(ValueError, match="unknown model 'alexnet'"):
        build_model("alexnet")
    with pytest.raises(ValueError, match="unknown model"):
        loss_fn("alexnet")
    with pytest.raises(ValueError, match="max_len=8"):
        build("transformer", max_len=8)(torch.ones(1, 9, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))


def test_loss_is_mean_cross_entropy_over_tokens():
    logits = torch.randn(2, 3, 5)
    target = torch.tensor([[1, 2, 3], [4, 2, 1]])
    manual = -torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).mean()
    assert torch.allclose(loss_fn("transformer")(logits, target), manual)


@pytest.mark.skipif(not os.path.isfile(os.path.join(FASHION_ROOT, "train-images-idx3-ubyte.gz")),
                    reason="Fashion-MNIST not installed")
def test_mlp_learns_fashion_mnist_in_two_epochs():
    """The 784-256-10 MLP with plain SGD (lr 0.1, batch 64) passes 84 % test accuracy after 2 epochs."""
    x, y = load_fashion_mnist("train")
    xt, yt = load_fashion_mnist("test")
    x, xt = to_tensor(x, (784,)), to_tensor(xt, (784,))
    y, yt = torch.from_numpy(y), torch.from_numpy(yt)
    model = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = BatchPlan(len(y), 64, 1, 0, seed=0)
    for epoch in range(2):
        for idx in plan.epoch(epoch):
            opt.zero_grad()
            loss_fn("mlp")(model(x[idx]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        accuracy = (model(xt).argmax(1) == yt).float().mean().item()
    assert accuracy > 0.84
