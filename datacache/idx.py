"""IDX files (the Fashion-MNIST format): header and size checks, and one Fashion-MNIST split as arrays."""

from __future__ import annotations

import gzip
import os
import zlib

import numpy as np

IMAGE_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions (count, rows, cols)
LABEL_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension (count)
FASHION_ROOT = "/usr/share/datasets/fashion-mnist"
_FASHION_PREFIX = {"train": "train", "test": "t10k"}
_UNREADABLE = (OSError, EOFError, zlib.error)  # BadGzipFile is an OSError, a gzip stream cut short an EOFError


def _open(path: str):
    """A binary file object for a plain or gzip-compressed IDX file (decided by content, not by name)."""
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")


def read_header(path: str, magic: int, ndim: int) -> tuple[int, ...]:
    """The dimensions an IDX file declares, once its magic number is checked (reads only the header)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"IDX file {path} not found")
    want = 4 * (1 + ndim)
    try:
        with _open(path) as f:
            head = f.read(want)
    except _UNREADABLE as e:
        raise ValueError(f"{path}: unreadable IDX file ({e})") from e
    if len(head) < want:
        raise ValueError(f"{path}: truncated IDX header ({len(head)} bytes, need {want})")
    found = int.from_bytes(head[:4], "big")
    if found != magic:
        raise ValueError(f"{path}: bad IDX magic number {found:#010x}, expected {magic:#010x}")
    return tuple(int.from_bytes(head[4 * k:4 * k + 4], "big") for k in range(1, ndim + 1))


def read_data(path: str, dims: tuple[int, ...]) -> np.ndarray:
    """The file's bytes after its header as a read-only uint8 array of shape `dims`, whose size they must fill."""
    try:
        with _open(path) as f:
            data = f.read()
    except _UNREADABLE as e:
        raise ValueError(f"{path}: unreadable IDX file ({e})") from e
    header, size = 4 * (1 + len(dims)), int(np.prod(dims))
    if len(data) - header != size:
        state = "truncated" if len(data) - header < size else "has trailing bytes"
        raise ValueError(f"{path}: IDX data {state}: header says {dims} = {size} bytes, "
                         f"file holds {len(data) - header}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def read_labelled(images_path: str, labels_path: str) -> tuple[tuple[int, int, int], np.ndarray]:
    """(image dimensions, labels uint8 [N]) of an images + labels pair; the images themselves are not read."""
    dims = read_header(images_path, IMAGE_MAGIC, 3)
    count = read_header(labels_path, LABEL_MAGIC, 1)[0]
    if dims[0] != count:
        raise ValueError(f"{images_path} holds {dims[0]} images but {labels_path} holds {count} labels")
    if count == 0:
        raise ValueError(f"no samples in {images_path}")
    return dims, read_data(labels_path, (count,))


def fashion_mnist_files(split: str = "train", root: str = FASHION_ROOT) -> tuple[str, str]:
    """The (images, labels) IDX files of one split ("train" or "test"), gzip-compressed or plain."""
    if split not in _FASHION_PREFIX:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    prefix = os.path.join(root, _FASHION_PREFIX[split])
    paths = []
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        found = [p for p in (f"{prefix}-{kind}.gz", f"{prefix}-{kind}") if os.path.isfile(p)]
        if not found:
            raise FileNotFoundError(f"Fashion-MNIST file {prefix}-{kind}[.gz] not found; install the dataset with "
                                    f"`apt-get install dataset-fashion-mnist` (as root), or pass root= pointing "
                                    f"at the IDX files")
        paths.append(found[0])
    return paths[0], paths[1]


def load_fashion_mnist(split: str = "train", root: str = FASHION_ROOT) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 [N, 28, 28] and labels int64 [N] of one split, as ordinary writable arrays."""
    images_path, labels_path = fashion_mnist_files(split, root)
    dims, labels = read_labelled(images_path, labels_path)
    if dims[1:] != (28, 28):
        raise ValueError(f"{images_path}: images are {dims[1]}x{dims[2]}, expected 28x28")
    if labels.max() > 9:
        raise ValueError(f"{labels_path}: label {int(labels.max())} out of range 0..9")
    return read_data(images_path, dims).copy(), labels.astype(np.int64)  # copy: frombuffer views are read-only
