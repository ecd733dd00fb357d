"""runtime.p3.copy_back: which finished slices go back to the device together, and when."""

from __future__ import annotations

from runtime.p3 import copy_back
from runtime.p3.copy_back import SliceCopyBack

SLICES = [(0, 0, 100), (0, 100, 200), (0, 200, 250), (1, 0, 100)]  # (buffer, start, stop); buffer 1 float64


def gather():
    sent = []
    return SliceCopyBack(SLICES, [4, 8], lambda tensors, ranges: sent.append((list(tensors), list(ranges)))), sent


def test_neighbours_merge_and_go_when_a_tensor_completes():
    back, sent = gather()
    back(0, [])
    back(1, [])
    assert sent == []  # 800 bytes gathered: below BACK_BYTES, no tensor complete
    back(2, [3, 4])
    assert sent == [([3, 4], [(0, 0, 250)])]
    back(3, [5])  # another buffer: a range of its own, nothing carried over
    assert sent[-1] == ([5], [(1, 0, 100)])


def test_out_of_order_slices_stay_separate_ranges():
    back, sent = gather()
    back(1, [])
    back(0, [0])
    assert sent == [([0], [(0, 100, 200), (0, 0, 100)])]


def test_enough_bytes_go_without_a_tensor_completing(monkeypatch):
    monkeypatch.setattr(copy_back, "BACK_BYTES", 700)
    back, sent = gather()
    back(0, [])
    assert sent == []
    back(1, [])  # 800 bytes >= 700
    assert sent == [([], [(0, 0, 200)])]
    back(3, [])  # 800 bytes of float64 alone
    assert sent[-1] == ([], [(1, 0, 100)])


def test_reset_drops_what_was_gathered():
    back, sent = gather()
    back(0, [])
    back.reset()
    back(2, [1])
    assert sent == [([1], [(0, 200, 250)])]
