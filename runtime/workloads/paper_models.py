"""The benchmark models at the papers' sizes: names, the Transformer's configuration, per-GPU batches, 224x224 data."""

from __future__ import annotations

import numpy as np
import torch

# runtime.workloads.models builds these (VGG19, ResNet50 and TransformerNMT with options); this module
# holds what they share with the jobs and imports nothing of models.py, so that models.py can import it.
PAPER_MODELS = ("vgg19-224", "vgg19-22k-224", "resnet50-224", "transformer-big")
IMAGENET_SIZE = 224
IMAGENET_CLASSES = 1000
# The "Transformer base" of Vaswani et al. 2017 (their Table 3), as TransformerNMT keywords. One 32,000-token
# vocabulary for both languages, so one embedding matrix serves the source, the target and the output
# projection, as in the paper: 60.6 M parameters (the paper's 65 M had a ~37,000-token vocabulary).
TRANSFORMER_BASE = dict(vocab=32_000, d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
                        dim_feedforward=2048, dropout=0.1, tie_weights=True, share_embeddings=True)
# Tokens per synthetic sentence for transformer-big: about the mean length of a WMT En-De training sentence
# in subwords (an assumption, not a figure from P3 or Sockeye).
WMT_SENTENCE_LEN = 32

# Per-GPU batch of each model in the paper it stands for; "assumed" marks a figure not checked in the paper.
PAPER_BATCH = {
    # P3 (Jayarajan et al., SysML 2019): its artifact (ctuning/reproduce-sysml19-paper-p3) trains VGG-19 and
    # ResNet-50 on 224x224 ImageNet at 32 per worker, one GPU each. MSTopK (Shi et al., 2021): assumed the same.
    "vgg19-224": 32,
    "resnet50-224": 32,
    # Poseidon (Zhang et al., USENIX ATC 2017), VGG19-22K on one GPU per machine: assumed 32.
    "vgg19-22k-224": 32,
    # In sentences of WMT_SENTENCE_LEN tokens (2,048 source tokens): assumed. Vaswani et al. batched about
    # 25,000 source tokens over 8 GPUs (~3,100 each); P3's artifact ran its Sockeye model at 32 sentences.
    "transformer-big": 64,
    # SpecTrain (Chen et al., 2018)-style pipelines, where every GPU sees the whole mini-batch: assumed,
    # jobs.bench.pipeline_worker's default of 64 per step.
    "fc-heavy": 64,
    "char-lstm": 64,
}


def paper_images(n: int, shape: tuple[int, ...], num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [n, *shape], y int64 [n]: Gaussian noise around one random prototype per class, as
    runtime.workloads.data.synthetic_classification, but drawing only the prototypes of the classes drawn.

    synthetic_classification draws every class's prototype first: at 3x224x224 that is 0.6 GB for 1,000
    classes and 13 GB for 21,841. Here class c's prototype comes from its own generator (seed, c), so a
    batch costs its own size and a larger draw with the same seed has the same class centres (which
    jobs.train's synthetic test set, the tail of a larger draw, relies on).
    """
    if n < 1 or num_classes < 1:
        raise ValueError(f"need n >= 1 and num_classes >= 1, got n={n}, num_classes={num_classes}")
    rng = np.random.default_rng(seed)
    shape = tuple(shape)
    y = rng.integers(0, num_classes, size=n)
    x = rng.standard_normal((n, *shape), dtype=np.float32)
    for c in np.unique(y):
        x[y == c] += np.random.default_rng((seed, int(c))).standard_normal(shape, dtype=np.float32)
    return torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
