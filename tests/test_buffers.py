"""Buffer views are zero-copy, reject what MPI cannot send safely, and reduce correctly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpicomm.buffers import Buffer, BufferError, block_counts, check_buffer, offsets, reduce_into


@pytest.mark.parametrize("obj", [np.arange(12, dtype=np.float32).reshape(3, 4),
                                 torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
                                 torch.arange(12, dtype=torch.int64)])
def test_views_share_memory(obj):
    b = Buffer(obj)
    assert b.count == 12
    raw = b.bytes(2, 5)
    assert raw.nbytes == 3 * b.itemsize and raw.dtype == np.uint8
    raw[...] = 0  # writing through the byte view changes the original: no copy was made
    flat = obj.reshape(-1)
    assert all(float(flat[i]) == 0 for i in range(2, 5)) and float(flat[5]) == 5


def test_copy_from_and_scratch():
    dst = Buffer(torch.zeros(6, dtype=torch.float16))
    src = dst.scratch(2)
    assert isinstance(src.obj, torch.Tensor) and src.obj.dtype == torch.float16 and src.count == 2
    src.obj[:] = torch.tensor([1.5, 2.5])
    dst.copy_from(src, 3)
    assert dst.obj.tolist() == [0, 0, 0, 1.5, 2.5, 0]


@pytest.mark.parametrize("obj,reason", [
    (np.ones((4, 4), np.float32).T, "non-contiguous numpy"),
    (torch.ones(4, 4).t(), "non-contiguous torch"),
    (np.ones(3, np.complex64), "unsupported dtype complex64"),
    (torch.ones(3, dtype=torch.complex64), "unsupported dtype complex64"),
    ([1.0, 2.0], "must be a numpy array or a CPU torch tensor"),
    (np.frombuffer(b"\0" * 8, dtype=np.float32), "read-only"),
])
def test_rejections_say_why(obj, reason):
    assert reason in check_buffer(obj)
    with pytest.raises(BufferError, match=reason.split()[0]):
        Buffer(obj)


def test_parameter_requiring_grad_is_accepted_without_copy():
    p = torch.nn.Parameter(torch.ones(3))
    b = Buffer(p)
    b.bytes()[...] = 0
    assert p.detach().sum().item() == 0


@pytest.mark.parametrize("op,expect", [("sum", [5, 7, 9]), ("prod", [4, 10, 18]), ("max", [4, 5, 6]),
                                       ("min", [1, 2, 3])])
def test_reduce_into_numpy_and_torch(op, expect):
    a, b = np.array([1, 2, 3], np.int32), np.array([4, 5, 6], np.int32)
    reduce_into(op, a, a, b)
    assert a.tolist() == expect
    ta, tb = torch.tensor([1.0, 2, 3]), torch.tensor([4.0, 5, 6])
    reduce_into(op, ta, ta, tb)
    assert ta.tolist() == expect


@pytest.mark.parametrize("n,p", [(0, 4), (1, 4), (3, 4), (5, 4), (16, 4), (7, 1)])
def test_block_counts_cover_everything_in_order(n, p):
    counts = block_counts(n, p)
    assert len(counts) == p and sum(counts) == n and max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)
    assert offsets(counts) == [sum(counts[:i]) for i in range(p)]
