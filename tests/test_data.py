"""Fashion-MNIST IDX loading, preprocessing, synthetic tasks and the per-rank BatchPlan (serial, no MPI)."""

from __future__ import annotations

import gzip
import os
import re

import numpy as np
import pytest
import torch

from runtime.data import (BOS, DEFAULT_FASHION_ROOT, FASHION_MEAN, FASHION_STD, FIRST_TOKEN, BatchPlan,
                          load_fashion_mnist, synthetic_classification, synthetic_seq2seq, to_tensor)

REAL = os.path.isfile(os.path.join(DEFAULT_FASHION_ROOT, "t10k-labels-idx1-ubyte.gz"))


def write_idx(path, magic: int, dims, payload: bytes) -> None:
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in dims)
    with gzip.open(path, "wb") as f:
        f.write(header + payload)


def write_split(root, n=5, prefix="train", images=None, labels=None):
    """A valid small split; returns the arrays written."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8) if images is None else images
    labels = rng.integers(0, 10, n, dtype=np.uint8) if labels is None else labels
    write_idx(root / f"{prefix}-images-idx3-ubyte.gz", 2051, images.shape, images.tobytes())
    write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", 2049, labels.shape, labels.tobytes())
    return images, labels


# ----------------------------------------------------------------------------- IDX loading

def test_small_idx_roundtrip(tmp_path):
    images, labels = write_split(tmp_path, n=7, prefix="t10k")
    x, y = load_fashion_mnist("test", root=str(tmp_path))
    assert x.dtype == np.uint8 and x.shape == (7, 28, 28) and x.flags.writeable
    assert y.dtype == np.int64 and y.shape == (7,)
    np.testing.assert_array_equal(x, images)
    np.testing.assert_array_equal(y, labels)


@pytest.mark.parametrize("which,magic,dims,payload,match", [
    ("images", 2049, (3, 28, 28), bytes(3 * 784), "bad IDX magic number 2049, expected 2051"),
    ("labels", 2051, (3,), bytes(3), "bad IDX magic number 2051, expected 2049"),
    ("images", 2051, (3, 28, 28), bytes(3 * 784 - 10), "truncated"),
    ("labels", 2049, (3,), bytes(2), "truncated"),
    ("images", 2051, (3, 28, 28), bytes(3 * 784 + 1), "trailing bytes"),
    ("images", 2051, (3, 27, 28), bytes(3 * 27 * 28), "27x28, expected 28x28"),
    ("labels", 2049, (4,), bytes(4), "holds 3 images but .* holds 4 labels"),
    ("labels", 2049, (3,), bytes([0, 1, 12]), "label 12 out of range"),
])
def test_corrupt_files_are_named(tmp_path, which, magic, dims, payload, match):
    write_split(tmp_path, n=3)
    path = tmp_path / f"train-{which}-idx{3 if which == 'images' else 1}-ubyte.gz"
    write_idx(path, magic, dims, payload)
    with pytest.raises(ValueError, match=match) as err:
        load_fashion_mnist("train", root=str(tmp_path))
    assert "ubyte.gz" in str(err.value)


def test_truncated_header_and_not_gzip(tmp_path):
    write_split(tmp_path, n=3)
    images = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(images, "wb") as f:
        f.write((2051).to_bytes(4, "big") + (3).to_bytes(4, "big"))
    with pytest.raises(ValueError, match="truncated IDX header"):
        load_fashion_mnist("train", root=str(tmp_path))
    images.write_bytes(b"this is not gzip at all")
    with pytest.raises(ValueError, match=re.escape(f"{images}: not a readable gzip file")):
        load_fashion_mnist("train", root=str(tmp_path))
    images.write_bytes(gzip.compress(bytes(500))[:20])  # gzip stream cut short
    with pytest.raises(ValueError, match="not a readable gzip file"):
        load_fashion_mnist("train", root=str(tmp_path))


def test_missing_files_say_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist") as err:
        load_fashion_mnist("train", root=str(tmp_path / "nowhere"))
    assert "train-images-idx3-ubyte.gz" in str(err.value)
    write_split(tmp_path, n=2)
    (tmp_path / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte.gz"):
        load_fashion_mnist("train", root=str(tmp_path))
    with pytest.raises(ValueError, match="split must be"):
        load_fashion_mnist("validation", root=str(tmp_path))


@pytest.mark.skipif(not REAL, reason=f"Fashion-MNIST not installed in {DEFAULT_FASHION_ROOT}")
def test_real_fashion_mnist():
    for split, n in (("train", 60000), ("test", 10000)):
        x, y = load_fashion_mnist(split)
        assert x.shape == (n, 28, 28) and x.dtype == np.uint8
        assert y.shape == (n,) and y.dtype == np.int64
        assert np.bincount(y).tolist() == [n // 10] * 10  # both splits are class-balanced
    assert abs(x.mean() / 255 - FASHION_MEAN) < 0.01 and abs(x.std() / 255 - FASHION_STD) < 0.01


# ----------------------------------------------------------------------------- preprocessing

def test_to_tensor_flat_and_normalized():
    imgs = np.zeros((2, 28, 28), np.uint8)
    imgs[1] = 255
    x = to_tensor(imgs, (784,))
    assert x.dtype == torch.float32 and x.shape == (2, 784)
    assert torch.allclose(x[0], torch.full((784,), -FASHION_MEAN / FASHION_STD))
    assert torch.allclose(x[1], torch.full((784,), (1 - FASHION_MEAN) / FASHION_STD))


def test_to_tensor_cnn_pads_and_repeats_channels():
    imgs = np.random.default_rng(1).integers(0, 256, (3, 28, 28), dtype=np.uint8)
    flat = to_tensor(imgs, (784,)).reshape(3, 28, 28)
    x = to_tensor(torch.from_numpy(imgs), (3, 32, 32))
    assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32 and x.is_contiguous()
    assert torch.equal(x[:, 0, 2:30, 2:30], flat)
    assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 0], x[:, 2])
    border = torch.ones(32, 32, dtype=torch.bool)
    border[2:30, 2:30] = False
    # Padding is black (raw 0), i.e. the normalized background value.
    assert torch.allclose(x[:, :, border], torch.tensor(-FASHION_MEAN / FASHION_STD))
    assert to_tensor(imgs, (1, 28, 28)).shape == (3, 1, 28, 28)


@pytest.mark.parametrize("images,shape,match", [
    (np.zeros((2, 28, 28), np.float32), (784,), "uint8"),
    (np.zeros((2, 784), np.uint8), (784,), "uint8"),
    (np.zeros((2, 28, 28), np.uint8), (1024,), "does not match"),
    (np.zeros((2, 28, 28), np.uint8), (3, 16, 16), "H' >= 28"),
    (np.zeros((2, 28, 28), np.uint8), (32, 32), "H' >= 28"),
])
def test_to_tensor_errors(images, shape, match):
    with pytest.raises(ValueError, match=match):
        to_tensor(images, shape)


# ----------------------------------------------------------------------------- synthetic tasks

def test_synthetic_classification():
    x, y = synthetic_classification(50, (3, 8, 8), 4, seed=3)
    assert x.dtype == torch.float32 and x.shape == (50, 3, 8, 8)
    assert y.dtype == torch.int64 and y.shape == (50,) and 0 <= y.min() and y.max() < 4
    x2, y2 = synthetic_classification(50, (3, 8, 8), 4, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = synthetic_classification(50, (3, 8, 8), 4, seed=4)
    assert not torch.equal(x, x3)
    # Learnable: samples of a class lie nearer their own class mean than another's.
    xs, ys = synthetic_classification(400, (16,), 2, seed=0)
    means = torch.stack([xs[ys == c].mean(0) for c in range(2)])
    assert (torch.cdist(xs, means).argmin(1) == ys).float().mean() > 0.95
    with pytest.raises(ValueError):
        synthetic_classification(0, (4,), 2, seed=0)


def test_synthetic_seq2seq_is_the_reversal_task():
    src, tgt = synthetic_seq2seq(6, 5, 5, vocab=20, seed=1)
    assert src.dtype == tgt.dtype == torch.int64 and src.shape == (6, 5) and tgt.shape == (6, 6)
    assert (tgt[:, 0] == BOS).all() and torch.equal(tgt[:, 1:], src.flip(1))
    assert src.min() >= FIRST_TOKEN and src.max() < 20
    src2, tgt2 = synthetic_seq2seq(6, 5, 5, vocab=20, seed=1)
    assert torch.equal(src, src2) and torch.equal(tgt, tgt2)
    # Longer targets keep cycling through the reversed source; shorter ones cut it.
    s, t = synthetic_seq2seq(2, 3, 7, vocab=20, seed=0)
    assert t[0, 1:].tolist() == [int(s[0, i]) for i in (2, 1, 0, 2, 1, 0, 2)]
    s, t = synthetic_seq2seq(2, 4, 2, vocab=20, seed=0)
    assert t[:, 1:].tolist() == s[:, [3, 2]].tolist()
    with pytest.raises(ValueError, match="reserved"):
        synthetic_seq2seq(2, 3, 3, vocab=2, seed=0)


# ----------------------------------------------------------------------------- BatchPlan

@pytest.mark.parametrize("num,local,ranks", [(100, 4, 3), (64, 8, 4), (1000, 7, 5), (10, 1, 10), (33, 16, 2)])
def test_ranks_concatenate_to_the_single_process_batch(num, local, ranks):
    single = BatchPlan(num, local * ranks, 1, 0, seed=11)
    plans = [BatchPlan(num, local, ranks, r, seed=11) for r in range(ranks)]
    assert all(len(p) == len(single) == num // (local * ranks) for p in plans)
    assert all(p.global_batch == local * ranks == single.global_batch for p in plans)
    for e in range(3):
        per_rank = [p.epoch(e) for p in plans]
        reference = single.epoch(e)
        assert len(reference) == len(single)
        for step, ref in enumerate(reference):
            assert all(b[step].shape == (local,) and b[step].dtype == np.int64 for b in per_rank)
            np.testing.assert_array_equal(np.concatenate([b[step] for b in per_rank]), ref)


def test_each_sample_at_most_once_per_epoch_across_ranks():
    num, local, ranks = 103, 5, 4
    for e in range(4):
        seen = np.concatenate([np.concatenate(BatchPlan(num, local, ranks, r, seed=2).epoch(e))
                               for r in range(ranks)])
        assert len(seen) == (num // 20) * 20 == len(np.unique(seen))
        assert seen.min() >= 0 and seen.max() < num


def test_deterministic_per_seed_and_epoch():
    a, b = BatchPlan(500, 10, 2, 1, seed=7), BatchPlan(500, 10, 2, 1, seed=7)
    for e in (0, 1, 5):
        assert all(np.array_equal(x, y) for x, y in zip(a.epoch(e), b.epoch(e)))
    assert not np.array_equal(np.concatenate(a.epoch(0)), np.concatenate(a.epoch(1)))
    other = BatchPlan(500, 10, 2, 1, seed=8)
    assert not np.array_equal(np.concatenate(a.epoch(0)), np.concatenate(other.epoch(0)))
    # Epoch e is seeded with seed + e: (seed 7, epoch 1) is (seed 8, epoch 0).
    assert all(np.array_equal(x, y) for x, y in zip(a.epoch(1), other.epoch(0)))


def test_no_shuffle_is_sequential():
    plan = BatchPlan(10, 2, 2, 1, seed=0, shuffle=False)
    assert [b.tolist() for b in plan.epoch(0)] == [[2, 3], [6, 7]]
    assert [b.tolist() for b in plan.epoch(3)] == [[2, 3], [6, 7]]


@pytest.mark.parametrize("args,match", [
    ((100, 0, 2, 0), "local_batch must be >= 1"),
    ((100, 4, 0, 0), "ranks must be >= 1"),
    ((100, 4, 2, 2), "0 <= rank < ranks=2"),
    ((100, 4, 2, -1), "0 <= rank < ranks=2"),
    ((7, 4, 2, 0), "7 samples is smaller than one global batch"),
])
def test_plan_errors(args, match):
    with pytest.raises(ValueError, match=match):
        BatchPlan(*args, seed=0)


def test_negative_seed_is_rejected_clearly():
    with pytest.raises(ValueError, match="seed \\+ epoch must be >= 0"):
        BatchPlan(10, 2, 1, 0, seed=-3).epoch(1)
