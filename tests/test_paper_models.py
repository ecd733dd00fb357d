"""The paper-size models (224x224 VGG-19 and ResNet-50, VGG19-22K, Transformer base): sizes, shapes, batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.pipeline import as_layers
from runtime.workloads.models import (FIXED_CLASSES, MODELS, PAPER_BATCH, PAPER_MODELS, TOKEN_MODELS, build_model,
                                      input_shape, loss_fn, model_input)
from runtime.workloads.paper_models import paper_images

torch.set_num_threads(1)

PARAM_COUNTS = {
    "vgg19-224": 143_667_240,      # torchvision's vgg19: 20,024,384 conv + 123,642,856 classifier
    "vgg19-22k-224": 229_052_817,  # the same with a 4096 x 21,841 head: Poseidon's "229 M" VGG19-22K
    "resnet50-224": 25_557_032,    # torchvision's resnet50
    # Transformer base (Vaswani et al. 2017) is ~60-65 M: the paper's 65 M had a ~37k shared vocabulary. Here
    # 32,000 x 512 for the one shared embedding (16.4 M) + 32,000 output bias + 44.1 M in the 6 + 6 layers.
    "transformer-big": 60_556_544,
}
OUTPUT = {"vgg19-224": (2, 1000), "vgg19-22k-224": (2, 21841), "resnet50-224": (2, 1000),
          "transformer-big": (2, 32, 32000)}


@pytest.fixture(scope="module")
def meta_models():
    """Each paper model built once on the meta device: shapes and no storage (vgg19-22k-224 would hold 0.9 GB)."""
    with torch.device("meta"):
        return {name: build_model(name) for name in PAPER_MODELS}


def meta_forward(model, inputs):
    return model(*(x.to("meta") for x in inputs))


def test_the_registry_knows_them():
    assert set(PAPER_MODELS) <= set(MODELS) and "transformer-big" in TOKEN_MODELS
    assert FIXED_CLASSES["vgg19-224"] == FIXED_CLASSES["resnet50-224"] == 1000
    assert FIXED_CLASSES["vgg19-22k-224"] == FIXED_CLASSES["vgg19-22k"] == 21841
    for name in ("vgg19-224", "vgg19-22k-224", "resnet50-224"):
        assert input_shape(name) == (3, 224, 224) and input_shape(name, 1) == (1, 224, 224)
    assert input_shape("vgg19") == (3, 32, 32)  # the CIFAR-size models keep theirs
    assert set(PAPER_BATCH) == {*PAPER_MODELS, "fc-heavy", "char-lstm"}
    assert all(isinstance(b, int) and b >= 1 for b in PAPER_BATCH.values())
    with pytest.raises(ValueError, match="image input shape"):
        input_shape("transformer-big")


def test_parameter_counts_are_the_papers(meta_models):
    for name, model in meta_models.items():
        assert sum(p.numel() for p in model.parameters()) == PARAM_COUNTS[name], name
        assert all(p.is_meta for p in model.parameters())


def test_vgg19_224_has_the_imagenet_layout(meta_models):
    model = meta_models["vgg19-224"]
    kinds = [type(m) for m in model.features]
    assert kinds.count(nn.Conv2d) == 16 and kinds.count(nn.ReLU) == 16 and kinds.count(nn.MaxPool2d) == 5
    assert isinstance(model.features[-1], nn.AdaptiveAvgPool2d) and model.features[-1].output_size == (7, 7)
    assert [type(m) for m in model.classifier] == [nn.Flatten, nn.Linear, nn.ReLU, nn.Dropout, nn.Linear, nn.ReLU,
                                                    nn.Dropout, nn.Linear]
    linears = [(m.in_features, m.out_features) for m in model.classifier if isinstance(m, nn.Linear)]
    assert linears == [(25088, 4096), (4096, 4096), (4096, 1000)]
    assert all(m.p == 0.5 for m in model.classifier if isinstance(m, nn.Dropout))
    assert meta_models["vgg19-22k-224"].classifier[-1].out_features == 21841
    with torch.device("meta"):
        assert not any(isinstance(m, nn.Dropout) for m in build_model("vgg19-224", dropout=0.0).modules())
        assert build_model("vgg19-224", num_classes=10).classifier[-1].out_features == 1000  # fixed head
        with pytest.raises(ValueError, match="image_size must be 32 or 224"):
            build_model("vgg19", image_size=64)


def test_resnet50_224_has_the_imagenet_stem_and_v1_5_strides(meta_models):
    model = meta_models["resnet50-224"]
    conv, _, _, pool = model.stem
    assert (conv.kernel_size, conv.stride, conv.padding) == ((7, 7), (2, 2), (3, 3))
    assert (pool.kernel_size, pool.stride, pool.padding) == (3, 2, 1)
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 1 + 16 * 3 + 4
    for stage in (model.layer2, model.layer3, model.layer4):  # the stride is on the 3x3 conv, not the 1x1
        assert stage[0].conv1.stride == (1, 1) and stage[0].conv2.stride == (2, 2)
    assert (model.fc.in_features, model.fc.out_features) == (2048, 1000)
    with torch.device("meta"):
        assert len(build_model("resnet50").stem) == 3  # the CIFAR stem is unchanged


@pytest.mark.parametrize("name", PAPER_MODELS)
def test_output_shapes_and_loss(meta_models, name):
    inputs, target = model_input(name, 2, seed=1)
    out = meta_forward(meta_models[name], inputs)
    assert tuple(out.shape) == OUTPUT[name] and out.dtype == torch.float32
    assert loss_fn(name)(out, target.to("meta")).shape == ()
    # The loss on real logits of that shape: finite, and log(classes) for uniform logits.
    loss = loss_fn(name)(torch.zeros(OUTPUT[name]), target)
    assert torch.isclose(loss, torch.log(torch.tensor(float(OUTPUT[name][-1]))))


def test_model_inputs():
    (x,), y = model_input("vgg19-22k-224", 3, seed=2)
    assert x.shape == (3, 3, 224, 224) and x.dtype == torch.float32 and y.shape == (3,) and y.max() < 21841
    (x,), y = model_input("resnet50-224", 2, seed=2, in_channels=1)
    assert x.shape == (2, 1, 224, 224) and y.max() < 1000
    (src, tgt_in), tgt_out = model_input("transformer-big", 2, seed=0)
    assert src.shape == tgt_in.shape == tgt_out.shape == (2, 32) and int(src.max()) < 32000
    assert torch.equal(tgt_out, src.flip(1))  # the reversal task, as for `transformer`
    assert model_input("transformer-big", 2, src_len=10, tgt_len=12)[0][0].shape == (2, 10)
    assert model_input("transformer", 2)[0][0].shape == (2, 16)  # the small model's defaults are unchanged


def test_paper_images_draw_only_the_classes_they_use():
    a, b = paper_images(4, (3, 224, 224), 21841, seed=5), paper_images(4, (3, 224, 224), 21841, seed=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # The same class has the same centre in a small and a larger draw of one seed (jobs.train's test set).
    small_x, small_y = paper_images(200, (500,), 2, seed=7)
    large_x, large_y = paper_images(600, (500,), 2, seed=7)
    means = [[x[y == c].mean(0) for c in (0, 1)] for x, y in ((small_x, small_y), (large_x, large_y))]
    assert (means[0][0] - means[1][0]).abs().mean() < 0.3 and (means[0][1] - means[1][1]).abs().mean() < 0.3
    assert (means[0][0] - means[0][1]).abs().mean() > 0.9  # and different classes different centres
    with pytest.raises(ValueError, match="num_classes >= 1"):
        paper_images(2, (3,), 0, seed=0)


def test_vgg19_224_pipeline_layers_compose_to_its_forward(meta_models):
    model = meta_models["vgg19-224"]
    chain = model.pipeline_layers()
    assert list(chain) == [*model.features, *model.classifier]
    layers = as_layers(model)
    assert len(layers) == 37 + 1 + 8  # convs, ReLUs, pools; the average pool; flatten and the classifier
    assert any(isinstance(m, nn.AdaptiveAvgPool2d) for m in layers) and any(isinstance(m, nn.Flatten) for m in layers)
    x = torch.empty(2, 3, 224, 224, device="meta")
    h = x
    for layer in layers:
        h = layer(h)
    assert h.shape == model(x).shape == (2, 1000)


def test_transformer_big_is_transformer_base_with_one_shared_embedding(meta_models):
    model = meta_models["transformer-big"]
    assert model.src_embed.weight is model.tgt_embed.weight is model.out.weight
    names = sorted(n for n, p in model.named_parameters(remove_duplicate=False) if p is model.out.weight)
    assert names == ["out.weight", "src_embed.weight", "tgt_embed.weight"]
    t = model.transformer
    assert (t.d_model, t.nhead, len(t.encoder.layers), len(t.decoder.layers)) == (512, 8, 6, 6)
    assert t.encoder.layers[0].linear1.out_features == 2048 and t.encoder.layers[0].dropout.p == 0.1
    with torch.device("meta"):
        assert build_model("transformer-big", share_embeddings=False).src_embed.weight is not model.tgt_embed.weight
        small = build_model("transformer")  # the small model still has its own source embedding
    assert small.src_embed.weight is not small.tgt_embed.weight and small.out.weight is small.tgt_embed.weight


def test_resnet50_224_trains_a_real_batch_of_one():
    """The one real (CPU) pass: about 1 s here for ResNet-50's 4 GFLOPs forward and its backward."""
    torch.manual_seed(0)
    model = build_model("resnet50-224")
    (x,), y = model_input("resnet50-224", 1, seed=0)
    loss = loss_fn("resnet50-224")(model(x), y)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_train_refuses_fashion_mnist_for_the_paper_models(capsys):
    from jobs.train import parse_args

    assert parse_args(["--model", "vgg19-224", "--data", "synthetic"]).model == "vgg19-224"
    for name, reason in (("vgg19-224", "has 1,000 classes"), ("transformer-big", "trains on sequences")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--model", name])
        assert exit_.value.code == 2 and reason in capsys.readouterr().err
