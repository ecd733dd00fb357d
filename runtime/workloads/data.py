"""Data as models take it: normalized, shaped images, synthetic tasks, the per-rank BatchPlan."""

from __future__ import annotations

import numpy as np
import torch

FASHION_MEAN = 0.2860
FASHION_STD = 0.3530

# Token ids reserved by the synthetic seq2seq task; content tokens are FIRST_TOKEN..vocab-1.
PAD, BOS = 0, 1
FIRST_TOKEN = 2


# ----------------------------------------------------------------------------- images

def to_tensor(images, shape: tuple[int, ...]) -> torch.Tensor:
    """Normalize uint8 images [N, 28, 28] to float32 and shape them for a model input.

    shape (784,) flattens for an MLP; shape (C, H, W) with H, W >= 28 pads each image evenly
    to H x W and repeats the gray channel C times. The padding is black (raw 0, the Fashion-MNIST
    background), so after normalization the border equals the image background, not 0.0.
    """
    x = torch.as_tensor(np.asarray(images))
    if x.dtype != torch.uint8 or x.dim() != 3:
        raise ValueError(f"images must be uint8 [N, H, W], got {x.dtype} {tuple(x.shape)}")
    # In place on the one float copy: the same operations in the same order (the same values), without
    # three more 70,000-image temporaries at every job's start.
    return fit_to_shape(x.float().div_(255.0).sub_(FASHION_MEAN).div_(FASHION_STD), shape)


def fit_to_shape(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Normalized gray images [N, H, W] or [N, 1, H, W] as a model takes them (see to_tensor)."""
    if x.dim() == 4:
        x = x[:, 0]
    n, h, w = x.shape
    shape = tuple(shape)
    if len(shape) == 1:
        if shape[0] != h * w:
            raise ValueError(f"flat shape {shape} does not match {h}x{w} images ({h * w} values)")
        return x.reshape(n, h * w).contiguous()
    if len(shape) != 3 or shape[1] < h or shape[2] < w or shape[0] < 1:
        raise ValueError(f"shape must be (H*W,) or (C, H', W') with H' >= {h}, W' >= {w}; got {shape}")
    c, th, tw = shape
    top, left = (th - h) // 2, (tw - w) // 2
    background = (0.0 - FASHION_MEAN) / FASHION_STD
    out = torch.full((n, 1, th, tw), background, dtype=torch.float32)
    out[:, 0, top:top + h, left:left + w] = x
    return out.expand(n, c, th, tw).contiguous()


# ----------------------------------------------------------------------------- synthetic tasks

def synthetic_classification(n: int, input_shape: tuple[int, ...], num_classes: int,
                             seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [n, *input_shape], y int64 [n]: Gaussian noise around one random prototype per class.

    The prototypes make the task learnable, so a short run shows the loss falling.
    """
    if n < 1 or num_classes < 1:
        raise ValueError(f"need n >= 1 and num_classes >= 1, got n={n}, num_classes={num_classes}")
    rng = np.random.default_rng(seed)
    shape = tuple(input_shape)
    prototypes = rng.standard_normal((num_classes, *shape), dtype=np.float32)
    y = rng.integers(0, num_classes, size=n)
    x = prototypes[y] + rng.standard_normal((n, *shape), dtype=np.float32)
    return torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))


def synthetic_seq2seq(n: int, src_len: int, tgt_len: int, vocab: int,
                      seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reversal task: src int64 [n, src_len], tgt int64 [n, tgt_len + 1].

    src holds content tokens FIRST_TOKEN..vocab-1. The target sentence is the source read
    backwards, cycling when tgt_len > src_len: token j is src[(src_len - 1 - j) mod src_len].
    tgt is that sentence with BOS prefixed, so teacher forcing uses tgt[:, :-1] as the decoder
    input and tgt[:, 1:] as the tokens to predict. No PAD appears (all sequences have full length).
    """
    if n < 1 or src_len < 1 or tgt_len < 1:
        raise ValueError(f"need n, src_len, tgt_len >= 1, got {n}, {src_len}, {tgt_len}")
    if vocab <= FIRST_TOKEN:
        raise ValueError(f"vocab must exceed the {FIRST_TOKEN} reserved tokens (PAD, BOS), got {vocab}")
    rng = np.random.default_rng(seed)
    src = rng.integers(FIRST_TOKEN, vocab, size=(n, src_len), dtype=np.int64)
    order = (src_len - 1 - np.arange(tgt_len)) % src_len
    tgt = np.empty((n, tgt_len + 1), dtype=np.int64)
    tgt[:, 0] = BOS
    tgt[:, 1:] = src[:, order]
    return torch.from_numpy(src), torch.from_numpy(tgt)


# ----------------------------------------------------------------------------- batch plan

class BatchPlan:
    """Deterministic data-parallel sampler: which sample indices rank `rank` uses at each step.

    Epoch e permutes all samples with default_rng(seed + e), cuts the permutation into global
    batches of local_batch * ranks (dropping the partial tail so every rank takes the same number
    of steps), and gives rank r the slice [r*local_batch, (r+1)*local_batch) of each. Hence the
    ranks' local batches of a step, concatenated in rank order, are exactly the batch a single
    process with BatchPlan(num_samples, local_batch * ranks, 1, 0, seed) takes at that step.
    """

    def __init__(self, num_samples: int, local_batch: int, ranks: int, rank: int, seed: int,
                 shuffle: bool = True):
        if local_batch < 1:
            raise ValueError(f"local_batch must be >= 1, got {local_batch}")
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        if not 0 <= rank < ranks:
            raise ValueError(f"rank must satisfy 0 <= rank < ranks={ranks}, got {rank}")
        if num_samples < local_batch * ranks:
            raise ValueError(f"dataset of {num_samples} samples is smaller than one global batch "
                             f"({local_batch} per rank x {ranks} ranks = {local_batch * ranks})")
        self.num_samples = int(num_samples)
        self.local_batch = int(local_batch)
        self.ranks = int(ranks)
        self.rank = int(rank)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.ranks

    def __len__(self) -> int:
        return self.num_samples // self.global_batch

    def order(self, e: int) -> np.ndarray:
        """The global sample order of epoch e (identical on every rank)."""
        if self.seed + e < 0:
            raise ValueError(f"seed + epoch must be >= 0 (numpy seeds are non-negative), got {self.seed} + {e}")
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return np.random.default_rng(self.seed + e).permutation(self.num_samples).astype(np.int64)

    def epoch(self, e: int) -> list[np.ndarray]:
        """This rank's index arrays for epoch e, one per step."""
        used = self.order(e)[:len(self) * self.global_batch].reshape(len(self), self.global_batch)
        lo = self.rank * self.local_batch
        return [row[lo:lo + self.local_batch].copy() for row in used]

    def __repr__(self) -> str:
        return (f"BatchPlan(num_samples={self.num_samples}, local_batch={self.local_batch}, "
                f"ranks={self.ranks}, rank={self.rank}, seed={self.seed}, shuffle={self.shuffle})")
