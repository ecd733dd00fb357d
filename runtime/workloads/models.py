"""The benchmark models (MLP, fc-heavy, small CNN, VGG-19, ResNet-50, Transformer NMT, char-LSTM), inputs, losses."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from runtime.workloads.data import PAD, synthetic_classification, synthetic_seq2seq
# PAPER_BATCH is unused here but re-exported: the jobs find the papers' batches beside the models' names.
from runtime.workloads.paper_models import (IMAGENET_CLASSES, IMAGENET_SIZE, PAPER_BATCH, PAPER_MODELS,
                                            TRANSFORMER_BASE, WMT_SENTENCE_LEN, paper_images)
from runtime.workloads.sequential import CHAR_VOCAB, CharLSTM, synthetic_text

MODELS = ("mlp", "vgg19", "resnet50", "transformer", "fc-heavy", "char-lstm", "vgg19-22k", "cnn", *PAPER_MODELS)
# Models whose output is [B, T, vocab] logits scored against [B, T] next tokens.
TOKEN_MODELS = ("transformer", "char-lstm", "transformer-big")

# VGG configuration E: output channels of the 16 conv layers, "M" = 2x2 max-pool.
VGG19_CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
                512, 512, 512, 512, "M", 512, 512, 512, 512, "M")
RESNET50_BLOCKS = (3, 4, 6, 3)
RESNET50_WIDTHS = (64, 128, 256, 512)  # bottleneck widths; block outputs are 4x these (256..2048)
# About 208 M parameters, nearly all in three 8192x8192 layers: gradients too big to all-reduce
# every step over slow links, the case for pipeline model parallelism.
FC_HEAVY_HIDDEN = (8192,) * 4
# VGG-19 with ImageNet-22K's 21,841-class head (about 128 M parameters, 89 M of them in the last
# layer): Poseidon's hardest case for data parallelism, the case for sufficient-factor broadcasting.
VGG19_22K_CLASSES = 21841
# Classes of a model whose head is part of its definition (the others take num_classes).
FIXED_CLASSES = {"vgg19-22k": VGG19_22K_CLASSES, "vgg19-224": IMAGENET_CLASSES, "vgg19-22k-224": VGG19_22K_CLASSES,
                 "resnet50-224": IMAGENET_CLASSES}
IMAGENET_MODELS = ("vgg19-224", "vgg19-22k-224", "resnet50-224")  # 224x224 inputs


# ----------------------------------------------------------------------------- MLP

class MLP(nn.Module):
    """in_features -> hidden... (ReLU after each) -> num_classes; flattens any [B, ...] input."""

    def __init__(self, num_classes: int = 10, hidden: int | Sequence[int] = 256, in_features: int = 784):
        super().__init__()
        widths = [hidden] if isinstance(hidden, int) else list(hidden)
        layers: list[nn.Module] = [nn.Flatten()]
        prev = in_features
        for w in widths:
            layers += [nn.Linear(prev, w), nn.ReLU()]
            prev = w
        layers.append(nn.Linear(prev, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def pipeline_layers(self) -> nn.Sequential:
        """The chain of layers forward() applies, for a pipeline to cut into stages."""
        return self.net


# ----------------------------------------------------------------------------- small CNN

class SmallCNN(nn.Sequential):
    """Two 5x5 convolutions (8, 16 channels) with ReLU and 2x2 max-pools, then 256 -> 64 -> classes; 1x28x28 in.

    A convolutional network small enough to train for epochs on a CPU, and a chain a pipeline can
    cut (10 layers): the CNN of SpecTrain's accuracy table (jobs.bench.pipeline_accuracy).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1):
        super().__init__(nn.Conv2d(in_channels, 8, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, num_classes))

    def pipeline_layers(self) -> nn.Sequential:
        return self


# ----------------------------------------------------------------------------- VGG-19

class VGG19(nn.Module):
    """VGG-19 (configuration E) with the ImageNet-size 4096-4096 classifier, for 32x32 or 224x224 inputs.

    image_size=32: five pools leave 1x1, so the classifier sees 512 features. image_size=224: five
    pools leave 7x7, an adaptive 7x7 average pool follows (the usual ImageNet layout; it also takes
    other input sizes to 7x7) and the classifier sees 25,088 features: 143.7 M parameters with 1000 classes.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, dropout: float = 0.0,
                 batch_norm: bool = False, image_size: int = 32):
        super().__init__()
        if image_size not in (32, IMAGENET_SIZE):
            raise ValueError(f"image_size must be 32 or {IMAGENET_SIZE}, got {image_size}")
        layers: list[nn.Module] = []
        prev = in_channels
        for c in VGG19_CONFIG:
            if c == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            # With batch norm the conv bias is redundant (BN subtracts the mean).
            layers.append(nn.Conv2d(prev, c, 3, padding=1, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm2d(c))
            layers.append(nn.ReLU())
            prev = c
        if image_size == IMAGENET_SIZE:
            # In `features`, so that pipeline_layers() (features then classifier) holds it too.
            layers.append(nn.AdaptiveAvgPool2d((7, 7)))
        self.features = nn.Sequential(*layers)
        head: list[nn.Module] = [nn.Flatten()]
        for fan_in in (512 if image_size == 32 else 512 * 7 * 7, 4096):
            head += [nn.Linear(fan_in, 4096), nn.ReLU()]
            if dropout > 0:
                head.append(nn.Dropout(dropout))
        head.append(nn.Linear(4096, num_classes))
        self.classifier = nn.Sequential(*head)
        # Sixteen plain conv layers do not train from PyTorch's default init (activations
        # shrink layer by layer); He init keeps their scale.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def pipeline_layers(self) -> nn.Sequential:
        """The chain of layers forward() applies, for a pipeline to cut into stages."""
        return nn.Sequential(*self.features, *self.classifier)


# ----------------------------------------------------------------------------- ResNet-50

class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand x4, plus a projection shortcut when shapes change."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


class ResNet50(nn.Module):
    """ResNet-50 (bottleneck blocks 3, 4, 6, 3; the stride on the 3x3 conv, "v1.5").

    image_size=32: a CIFAR stem, one 3x3 conv and no max-pool. image_size=224: the ImageNet stem,
    7x7 conv stride 2 then 3x3 max-pool stride 2 (224 -> 56), 25.6 M parameters with 1000 classes.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32):
        super().__init__()
        if image_size == 32:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, padding=1, bias=False),
                                      nn.BatchNorm2d(64), nn.ReLU())
        elif image_size == IMAGENET_SIZE:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False),
                                      nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        else:
            raise ValueError(f"image_size must be 32 or {IMAGENET_SIZE}, got {image_size}")
        stages: list[nn.Module] = []
        prev = 64
        for i, (blocks, width) in enumerate(zip(RESNET50_BLOCKS, RESNET50_WIDTHS)):
            stage = []
            for b in range(blocks):
                # The first block of stages 2-4 halves the resolution (32 -> 16 -> 8 -> 4; 56 -> 28 -> 14 -> 7).
                stride = 2 if (b == 0 and i > 0) else 1
                stage.append(Bottleneck(prev, width, stride))
                prev = width * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(prev, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


# ----------------------------------------------------------------------------- Transformer NMT

def sinusoidal_positions(length: int, d_model: int) -> torch.Tensor:
    """[length, d_model]: sin on even dims, cos on odd dims, wavelengths 2*pi .. 10000*2*pi."""
    pos = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


class TransformerNMT(nn.Module):
    """Encoder-decoder translation model: forward(src [B, S], tgt_in [B, T]) -> logits [B, T, vocab].

    With tie_weights the output projection's weight *is* the target embedding's weight: one
    Parameter registered in two modules (tgt_embed.weight and out.weight), so it is listed once
    by parameters() but receives gradient from both uses. With share_embeddings (one vocabulary for
    both languages) the source embedding's weight is that Parameter too.
    """

    def __init__(self, vocab: int = 1000, d_model: int = 256, nhead: int = 4, num_encoder_layers: int = 3,
                 num_decoder_layers: int = 3, dim_feedforward: int = 1024, dropout: float = 0.0,
                 max_len: int = 512, tie_weights: bool = True, share_embeddings: bool = False):
        super().__init__()
        self.d_model = d_model
        self.src_embed = nn.Embedding(vocab, d_model)
        self.tgt_embed = nn.Embedding(vocab, d_model)
        # Embeddings scaled by sqrt(d_model) on input start at unit scale; with the tied output
        # projection this also keeps the initial logits near unit scale (N(0,1) would give ~16).
        for emb in (self.src_embed, self.tgt_embed):
            nn.init.normal_(emb.weight, 0.0, d_model ** -0.5)
        # A buffer, not a parameter: fixed positions are neither trained nor communicated.
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.transformer = nn.Transformer(d_model=d_model, nhead=nhead, num_encoder_layers=num_encoder_layers,
                                          num_decoder_layers=num_decoder_layers, dim_feedforward=dim_feedforward,
                                          dropout=dropout, batch_first=True)
        self.out = nn.Linear(d_model, vocab)
        if tie_weights:
            self.out.weight = self.tgt_embed.weight
        if share_embeddings:
            self.src_embed.weight = self.tgt_embed.weight

    def _embed(self, emb: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        if n > self.positions.shape[0]:
            raise ValueError(f"sequence of {n} tokens exceeds max_len={self.positions.shape[0]}")
        return emb(tokens) * math.sqrt(self.d_model) + self.positions[:n]

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        t = tgt_in.shape[1]
        # Causal mask: decoder position i may attend to positions <= i only; made where the tokens are, so that
        # attention never meets a host mask beside device tensors (torch drops it for tgt_is_causal only on some paths).
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=tgt_in.device)
        h = self.transformer(self._embed(self.src_embed, src), self._embed(self.tgt_embed, tgt_in),
                             tgt_mask=causal, tgt_is_causal=True)
        return self.out(h)


# ----------------------------------------------------------------------------- registry

def build_model(name: str, num_classes: int = 10, in_channels: int = 3, **kw) -> nn.Module:
    """Build a benchmark model by name (see MODELS); extra keywords go to its constructor.

    mlp: hidden=256 (int or list), in_features=784 (in_channels is ignored: input is 28x28 flat).
    cnn: none (in_channels is ignored: input is 1x28x28, Fashion-MNIST's gray images).
    vgg19: dropout=0.0, batch_norm=False; vgg19-22k: the same, 21,841 classes whatever num_classes says.
    resnet50: none.
    transformer: vocab=1000, d_model=256, nhead=4, num_encoder_layers=3, num_decoder_layers=3,
    dim_feedforward=1024, dropout=0.0, max_len=512, tie_weights=True (num_classes, in_channels ignored).
    fc-heavy: the MLP with hidden=FC_HEAVY_HIDDEN (override with hidden=), in_features=784.
    char-lstm: vocab=CHAR_VOCAB, embed=64, hidden=512, layers=3 (num_classes, in_channels ignored).

    At the papers' sizes (PAPER_MODELS; per-GPU batches in PAPER_BATCH), whatever num_classes says:
    vgg19-224: VGG-19 on 224x224 ImageNet inputs, 1000 classes, dropout=0.5 before the 2nd and 3rd
    FC layers (143,667,240 parameters, as the ImageNet network); the vgg19 options apply.
    vgg19-22k-224: the same with 21,841 classes, Poseidon's VGG19-22K (229,052,817 parameters).
    resnet50-224: ResNet-50 with the ImageNet stem, 1000 classes (25,557,032 parameters).
    transformer-big: TransformerNMT with TRANSFORMER_BASE, the "Transformer base" of Vaswani et al.
    2017 (d_model 512, 8 heads, 6 + 6 layers, feed-forward 2048, dropout 0.1) on a shared vocabulary
    of 32,000 whose one embedding matrix is the source and target embedding and the output
    projection (60,556,544 parameters); "big" next to `transformer`, not Vaswani's Transformer big.
    It stands for a Transformer NMT model as Sockeye trains them (P3's artifact itself ran Sockeye's
    2-layer LSTM model on IWSLT15); the transformer keywords override any of TRANSFORMER_BASE.
    """
    if name == "mlp":
        return MLP(num_classes, **kw)
    if name == "cnn":
        return SmallCNN(num_classes, **kw)
    if name == "vgg19":
        return VGG19(num_classes, in_channels, **kw)
    if name == "vgg19-22k":
        return VGG19(VGG19_22K_CLASSES, in_channels, **kw)
    if name == "resnet50":
        return ResNet50(num_classes, in_channels, **kw)
    if name in ("vgg19-224", "vgg19-22k-224"):
        return VGG19(FIXED_CLASSES[name], in_channels, **{"dropout": 0.5, **kw}, image_size=IMAGENET_SIZE)
    if name == "resnet50-224":
        return ResNet50(FIXED_CLASSES[name], in_channels, **kw, image_size=IMAGENET_SIZE)
    if name == "transformer-big":
        return TransformerNMT(**{**TRANSFORMER_BASE, **kw})
    if name == "transformer":
        return TransformerNMT(**kw)
    if name == "fc-heavy":
        return MLP(num_classes, **{"hidden": FC_HEAVY_HIDDEN, **kw})
    if name == "char-lstm":
        return CharLSTM(**kw)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def input_shape(name: str, in_channels: int = 3) -> tuple[int, ...]:
    """Per-sample input shape of an image model: (784,) for the MLPs, (1, 28, 28) for cnn, (C, 224, 224) for
    IMAGENET_MODELS, (C, 32, 32) for the others."""
    if name in ("mlp", "fc-heavy"):
        return (784,)
    if name == "cnn":
        return (1, 28, 28)
    if name in ("vgg19", "vgg19-22k", "resnet50"):
        return (in_channels, 32, 32)
    if name in IMAGENET_MODELS:
        return (in_channels, IMAGENET_SIZE, IMAGENET_SIZE)
    raise ValueError(f"model {name!r} has no image input shape; image models are mlp, fc-heavy, cnn, vgg19, "
                     f"vgg19-22k, resnet50, {', '.join(IMAGENET_MODELS)}")


def model_input(name: str, batch: int, seed: int = 0, num_classes: int | None = None, in_channels: int = 3,
                vocab: int | None = None, src_len: int | None = None, tgt_len: int | None = None,
                seq_len: int = 64) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A synthetic batch (inputs, target) for model `name`; call it as loss_fn(name)(model(*inputs), target).

    Image models: inputs = (x,), target = class ids [batch] (IMAGENET_MODELS: [batch, C, 224, 224]
    from paper_images). Transformer: inputs = (src [batch, src_len], tgt_in [batch, tgt_len]),
    target = next tokens [batch, tgt_len] (the reversal task; vocab 1000, lengths 16 by default;
    transformer-big: vocab 32,000, lengths WMT_SENTENCE_LEN = 32, a typical WMT training sentence).
    char-lstm: inputs = (tokens [batch, seq_len],), target = next tokens [batch, seq_len] (vocab
    CHAR_VOCAB by default).
    """
    if name in ("transformer", "transformer-big"):
        big = name == "transformer-big"
        length, default_vocab = (WMT_SENTENCE_LEN, TRANSFORMER_BASE["vocab"]) if big else (16, 1000)
        src_len = length if src_len is None else src_len
        tgt_len = length if tgt_len is None else tgt_len
        src, tgt = synthetic_seq2seq(batch, src_len, tgt_len, default_vocab if vocab is None else vocab, seed)
        return (src, tgt[:, :-1]), tgt[:, 1:].contiguous()
    if name == "char-lstm":
        x, y = synthetic_text(batch, seq_len, CHAR_VOCAB if vocab is None else vocab, seed)
        return (x,), y
    classes = FIXED_CLASSES.get(name, 10 if num_classes is None else num_classes)
    make = paper_images if name in IMAGENET_MODELS else synthetic_classification
    x, y = make(batch, input_shape(name, in_channels), classes, seed)
    return (x,), y


def _classification_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def _token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Mean over every target token of the batch; PAD positions (if any) are not counted. For the
    # char-LSTM id 0 is the unknown character: not scored either (a handful in the Austen corpus).
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), ignore_index=PAD)


def loss_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross-entropy for model `name`: over classes, or over all target tokens for TOKEN_MODELS."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return _token_loss if name in TOKEN_MODELS else _classification_loss
