"""Data as models take it: normalized, shaped images, synthetic tasks, the per-rank BatchPlan, batches fed to a GPU."""

from __future__ import annotations

from collections import deque

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
    return fit_to_shape((x.float() / 255.0 - FASHION_MEAN) / FASHION_STD, shape)


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


# ----------------------------------------------------------------------------- batches to the device

class DeviceFeed:
    """Host batches onto the training device: on a GPU through reused pinned buffers and non-blocking copies.

    On the CPU (staged=False, the default there) batches pass through untouched. Staged (the default
    on CUDA), each tensor is first written into a host staging buffer of its shape and dtype, pinned
    on CUDA so that `.to(device, non_blocking=True)` is a DMA the host does not wait for, then
    copied to the device; the copy is a new device tensor, the buffer is kept. Pinning page-locks
    memory through the driver, far dearer than a copy, so buffers are made once and reused:
    a buffer is refilled only once the copy that last read it is over (its CUDA event), else
    another is made, up to `max_buffers` per shape, beyond which the host waits for the oldest.
    staged=True on the CPU runs the same bookkeeping in ordinary memory, so CPU tests cover it.
    """

    MAX_SHAPES = 8  # batch shapes kept (a cache that skipped samples yields short batches)

    def __init__(self, device, staged: bool | None = None, max_buffers: int = 4):
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be >= 1, got {max_buffers}")
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.staged = self.pinned if staged is None else bool(staged)
        self.max_buffers = max_buffers
        # (shape, dtype) -> deque of [buffer, event or None], least recently filled first; the dict is
        # kept in order of use so that the shape unused longest is the one dropped.
        self._pools: dict[tuple, deque] = {}

    def __call__(self, tensors) -> tuple[torch.Tensor, ...]:
        """These host tensors on the device, equal in value."""
        if not self.staged:
            return tuple(t.to(self.device) for t in tensors)
        return tuple(self._send(t.shape, t.dtype, lambda buf, t=t: buf.copy_(t)) for t in tensors)

    def take(self, tensors, idx) -> tuple[torch.Tensor, ...]:
        """Rows `idx` of each host tensor, on the device: gathered straight into the staging buffer."""
        idx = torch.as_tensor(idx)
        if not self.staged:
            return tuple(t[idx].to(self.device) for t in tensors)
        return tuple(self._send((len(idx), *t.shape[1:]), t.dtype,
                                lambda buf, t=t: torch.index_select(t, 0, idx, out=buf)) for t in tensors)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The staging buffers held now, every shape."""
        return [slot[0] for pool in self._pools.values() for slot in pool]

    def _send(self, shape, dtype, fill) -> torch.Tensor:
        slot = self._slot(tuple(shape), dtype)
        fill(slot[0])
        # copy=True: a tensor of its own on a CPU device too, as the GPU copy is, so the buffer can be reused.
        out = slot[0].to(self.device, non_blocking=self.pinned, copy=True)
        if slot[1] is not None:
            slot[1].record()  # on the current stream, after the copy: done means the buffer is free
        return out

    def _slot(self, shape: tuple, dtype: torch.dtype) -> list:
        key = (shape, dtype)
        pool = self._pools.pop(key, None)
        if pool is None:
            pool = deque()
            if len(self._pools) >= self.MAX_SHAPES:
                # Freeing a pinned buffer mid-copy is safe: torch's host allocator holds it until its copies end.
                self._pools.pop(next(iter(self._pools)))
        self._pools[key] = pool
        # One stream's copies end in order: if the oldest is still running, so are the rest.
        if pool and (pool[0][1] is None or pool[0][1].query()):
            slot = pool.popleft()
        elif len(pool) < self.max_buffers:
            slot = [torch.empty(shape, dtype=dtype, pin_memory=self.pinned),
                    torch.cuda.Event() if self.pinned else None]
        else:
            slot = pool.popleft()
            slot[1].synchronize()  # max_buffers copies in flight: the GPU is that far behind anyway
        pool.append(slot)
        return slot
