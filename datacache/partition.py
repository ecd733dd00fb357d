"""Which samples each rank caches, and the per-epoch order and batches that keep ranks in step."""

from __future__ import annotations

import math

import numpy as np


def partition(n: int, ranks: int, rank: int, seed: int = 0) -> np.ndarray:
    """Sample ids rank `rank` owns: a fixed random 1/ranks of range(n), sorted (sources read faster in order).

    Every id belongs to exactly one rank; sizes differ by at most one. The
    split is random rather than contiguous so that each rank's part holds
    every class in proportion even when the source is sorted by label.
    """
    if n < 1:
        raise ValueError("the dataset has no samples")
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} outside [0, {ranks})")
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[rank::ranks]).astype(np.int64)


def steps_per_epoch(n: int, ranks: int, batch_size: int) -> int:
    """The same on every rank: enough batches of at most batch_size for the largest part."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return max(1, math.ceil(math.ceil(n / ranks) / batch_size))


def epoch_batches(count: int, steps: int, epoch: int, seed: int = 0, rank: int = 0) -> list[np.ndarray]:
    """This rank's positions 0..count-1 in a fresh random order for `epoch`, cut into exactly `steps` batches.

    Batches are near-equal in size (never empty while count >= steps), so a
    rank with one sample fewer runs the same number of steps as the others
    and every sample is served exactly once per epoch.
    """
    order = np.random.default_rng([seed, epoch, rank]).permutation(count)
    return [b for b in np.array_split(order, steps)]
