"""Preprocessing for models, synthetic tasks, the per-rank BatchPlan, the DeviceFeed (serial); IDX: test_datacache_idx."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.device import DeviceFeed
from runtime.workloads.data import (BOS, FASHION_MEAN, FASHION_STD, FIRST_TOKEN, BatchPlan, synthetic_classification,
                                    synthetic_seq2seq, to_tensor)

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


def test_to_tensor_normalizes_in_place_on_its_own_copy_only():
    """Every value is (x / 255 - mean) / std as float32 computes it, and the caller's images stay as they were."""
    imgs = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (4, 28, 28), dtype=np.uint8))
    kept = imgs.clone()
    x = to_tensor(imgs, (784,))
    assert torch.equal(imgs, kept)
    assert torch.equal(x, ((kept.float() / 255.0 - FASHION_MEAN) / FASHION_STD).reshape(4, 784))


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


# ----------------------------------------------------------------------------- DeviceFeed

def _batch(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 4, generator=g), torch.randint(0, 9, (n,), generator=g)


@pytest.mark.parametrize("staged", [False, True], ids=["plain", "staged"])
def test_device_feed_returns_the_batch_on_the_cpu(staged):
    feed = DeviceFeed("cpu", staged=staged)
    x, y = _batch(0)
    got = feed((x, y))
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, (x, y)))
    idx = np.array([5, 0, 3])
    got = feed.take((x, y), idx)
    assert torch.equal(got[0], x[idx]) and torch.equal(got[1], y[idx]) and got[1].dtype == torch.int64


def test_device_feed_staged_reuses_its_buffers_and_hands_out_copies():
    feed = DeviceFeed("cpu", staged=True)
    outs, wants = [], []
    for step in range(10):
        x, y = _batch(step)
        outs.append(feed((x, y)))
        wants.append((x.clone(), y.clone()))
        x.zero_()  # the caller may reuse its tensor at once: the feed copied it
    assert all(torch.equal(o[0], w[0]) and torch.equal(o[1], w[1]) for o, w in zip(outs, wants))
    assert len(feed.buffers) == 2  # one per tensor, reused every step (a CPU copy is over when it returns)
    assert all(not any(o.data_ptr() == b.data_ptr() for b in feed.buffers) for out in outs for o in out)


def test_device_feed_keeps_a_buffer_per_shape_up_to_a_limit():
    feed = DeviceFeed("cpu", staged=True)
    x, y = _batch(1, n=40)
    for n in range(1, DeviceFeed.MAX_SHAPES + 4):  # short batches (a cache that skipped samples)
        got = feed.take((x, y), np.arange(n))
        assert torch.equal(got[0], x[:n]) and torch.equal(got[1], y[:n])
    assert len(feed.buffers) <= 2 * DeviceFeed.MAX_SHAPES
    with pytest.raises(ValueError, match="max_buffers must be >= 1"):
        DeviceFeed("cpu", max_buffers=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
def test_device_feed_on_cuda_is_pinned_and_non_blocking():
    feed = DeviceFeed("cuda")
    assert feed.staged and feed.pinned
    first = [_batch(step, n=256) for step in range(3)]  # fewer than max_buffers: no buffer waited for
    # Keep the GPU busy so that the copies queue behind the sleep: the feed must return before they run.
    torch.cuda._sleep(200_000_000)
    outs = [feed(b) for b in first]
    assert not any(slot[1].query() for pool in feed._pools.values() for slot in pool), "a copy was waited for"
    # More batches than buffers: the oldest are refilled only once their copies are over.
    more = [_batch(step, n=256) for step in range(3, 15)]
    outs += [feed(b) for b in more]
    assert all(b.is_pinned() for b in feed.buffers) and len(feed.buffers) <= 2 * feed.max_buffers
    torch.cuda.synchronize()
    for (x, y), (gx, gy) in zip(first + more, outs):
        assert gx.is_cuda and gy.is_cuda and torch.equal(gx.cpu(), x) and torch.equal(gy.cpu(), y)
    got = feed.take(first[0], torch.tensor([3, 1]))
    assert torch.equal(got[0].cpu(), first[0][0][[3, 1]]) and torch.equal(got[1].cpu(), first[0][1][[3, 1]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (torch sees fewer)")
def test_device_feed_marks_its_buffer_free_on_the_stream_that_copied():
    """Feeding the second GPU while the first is current: the buffer's event is recorded on the second GPU's
    stream, behind the copy (recorded on the first's, it would say free while the copy still waits)."""
    torch.cuda.set_device(0)
    feed = DeviceFeed("cuda:1")
    with torch.cuda.device(1):
        torch.cuda._sleep(200_000_000)  # the copy queues behind this on GPU 1
    feed(_batch(0, n=256))
    assert not any(slot[1].query() for pool in feed._pools.values() for slot in pool), "event on the wrong stream"
    torch.cuda.synchronize(1)
    assert all(slot[1].query() for pool in feed._pools.values() for slot in pool)
