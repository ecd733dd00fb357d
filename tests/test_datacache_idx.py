"""datacache.idx: IDX parsing and Fashion-MNIST as arrays, one reader shared by jobs.train and IdxSource (serial)."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from datacache_helpers import write_idx, write_idx_pair

from conftest import ROOT
from datacache.idx import FASHION_ROOT, load_fashion_mnist
from datacache.sources import IdxSource
from runtime.workloads.data import FASHION_MEAN, FASHION_STD

REAL = os.path.isfile(os.path.join(FASHION_ROOT, "t10k-labels-idx1-ubyte.gz"))


def test_small_idx_roundtrip(tmp_path):
    images, labels = write_idx_pair(tmp_path, n=7, prefix="t10k")
    x, y = load_fashion_mnist("test", root=str(tmp_path))
    assert x.dtype == np.uint8 and x.shape == (7, 28, 28) and x.flags.writeable
    assert y.dtype == np.int64 and y.shape == (7,)
    np.testing.assert_array_equal(x, images)
    np.testing.assert_array_equal(y, labels)


@pytest.mark.parametrize("compressed", [True, False])
def test_arrays_and_idx_source_read_the_same_files_alike(tmp_path, compressed):
    """One reader: what jobs.train loads is what the cache's IdxSource serves, gzip-compressed or plain."""
    images, labels = write_idx_pair(tmp_path, n=6)
    if not compressed:
        for gz in tmp_path.glob("*.gz"):
            gz.with_suffix("").write_bytes(gzip.decompress(gz.read_bytes()))
            gz.unlink()
    x, y = load_fashion_mnist("train", root=str(tmp_path))
    src = IdxSource.fashion_mnist("train", root=str(tmp_path))
    np.testing.assert_array_equal(x, images)
    np.testing.assert_array_equal(np.stack([src.raw(i) for i in range(len(src))]), x)
    np.testing.assert_array_equal(src.labels(), y)


@pytest.mark.parametrize("which,magic,dims,payload,match", [
    ("images", 2049, (3, 28, 28), bytes(3 * 784), "bad IDX magic number 0x00000801, expected 0x00000803"),
    ("labels", 2051, (3,), bytes(3), "bad IDX magic number 0x00000803, expected 0x00000801"),
    ("images", 2051, (3, 28, 28), bytes(3 * 784 - 10), "truncated"),
    ("labels", 2049, (3,), bytes(2), "truncated"),
    ("images", 2051, (3, 28, 28), bytes(3 * 784 + 1), "trailing bytes"),
    ("images", 2051, (3, 27, 28), bytes(3 * 27 * 28), "27x28, expected 28x28"),
    ("labels", 2049, (4,), bytes(4), "holds 3 images but .* holds 4 labels"),
    ("labels", 2049, (3,), bytes([0, 1, 12]), "label 12 out of range"),
])
def test_corrupt_files_are_named(tmp_path, which, magic, dims, payload, match):
    write_idx_pair(tmp_path, n=3)
    path = tmp_path / f"train-{which}-idx{3 if which == 'images' else 1}-ubyte.gz"
    write_idx(path, magic, dims, payload)
    with pytest.raises(ValueError, match=match) as err:
        load_fashion_mnist("train", root=str(tmp_path))
    assert "ubyte.gz" in str(err.value)


def test_truncated_header_and_not_gzip(tmp_path):
    write_idx_pair(tmp_path, n=3)
    images = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(images, "wb") as f:
        f.write((2051).to_bytes(4, "big") + (3).to_bytes(4, "big"))
    with pytest.raises(ValueError, match="truncated IDX header"):
        load_fashion_mnist("train", root=str(tmp_path))
    images.write_bytes(b"this is not gzip at all")  # read as a plain IDX file: its magic number is wrong
    with pytest.raises(ValueError, match=re.escape(f"{images}: bad IDX magic number")):
        load_fashion_mnist("train", root=str(tmp_path))
    images.write_bytes(gzip.compress(bytes(5000))[:20])  # gzip stream cut short
    with pytest.raises(ValueError, match=re.escape(f"{images}: unreadable IDX file")):
        load_fashion_mnist("train", root=str(tmp_path))


def test_missing_files_say_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist") as err:
        load_fashion_mnist("train", root=str(tmp_path / "nowhere"))
    assert "train-images-idx3-ubyte[.gz]" in str(err.value)
    write_idx_pair(tmp_path, n=2)
    (tmp_path / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape("train-labels-idx1-ubyte[.gz] not found")):
        load_fashion_mnist("train", root=str(tmp_path))
    with pytest.raises(ValueError, match="split must be"):
        load_fashion_mnist("validation", root=str(tmp_path))


def test_runtime_does_not_import_datacache():
    """The layering jobs -> runtime | datacache -> mpicomm: runtime and datacache are peers."""
    code = "import sys, runtime, runtime.workloads.data, runtime.workloads.models; assert 'datacache' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.skipif(not REAL, reason=f"Fashion-MNIST not installed in {FASHION_ROOT}")
def test_real_fashion_mnist():
    for split, n in (("train", 60000), ("test", 10000)):
        x, y = load_fashion_mnist(split)
        assert x.shape == (n, 28, 28) and x.dtype == np.uint8
        assert y.shape == (n,) and y.dtype == np.int64
        assert np.bincount(y).tolist() == [n // 10] * 10  # both splits are class-balanced
    assert abs(x.mean() / 255 - FASHION_MEAN) < 0.01 and abs(x.std() / 255 - FASHION_STD) < 0.01
