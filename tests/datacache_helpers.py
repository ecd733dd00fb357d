"""Small real image datasets on disk for the datacache tests, and fresh preprocessing to compare with."""

from __future__ import annotations

import csv
import gzip
import hashlib
import os

import numpy as np


def make_png_dataset(root, n: int = 103, size: int = 8, seed: int = 0, garbage: int = 0) -> str:
    """n random gray PNG files plus labels.csv in root; `garbage` more files that are not images."""
    from PIL import Image

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        name = f"img-{i:04d}.png"
        Image.fromarray(rng.integers(0, 256, (size, size), dtype=np.uint8), mode="L").save(os.path.join(root, name))
        rows.append((name, int(rng.integers(0, 10))))
    for g in range(garbage):
        name = f"broken-{g}.png"
        with open(os.path.join(root, name), "wb") as f:
            f.write(b"this is not a png")
        rows.append((name, 0))
    with open(os.path.join(root, "labels.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filename", "label"])
        w.writerows(rows)
    return str(root)


def write_idx(path, magic: int, dims, payload: bytes) -> None:
    """A gzip-compressed IDX file: magic number, dimensions, then `payload` (which need not match them)."""
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in dims)
    with gzip.open(path, "wb") as f:
        f.write(header + payload)


def write_idx_pair(root, n: int = 5, prefix: str = "train"):
    """A valid split of n random 28x28 images in root, as Fashion-MNIST names it; returns (images, labels)."""
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    write_idx(root / f"{prefix}-images-idx3-ubyte.gz", 2051, images.shape, images.tobytes())
    write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", 2049, labels.shape, labels.tobytes())
    return images, labels


def sample_digest(x, y) -> str:
    return hashlib.sha1(np.ascontiguousarray(x).tobytes() + int(y).to_bytes(8, "little")).hexdigest()


def fresh_digests(source, pipeline, skip_unreadable: bool = True) -> list[str]:
    """Digest of every sample preprocessed directly from the source: what the cache must serve."""
    from datacache.sources import UnreadableSample

    out = []
    for i in range(len(source)):
        try:
            out.append(sample_digest(pipeline.apply(source.raw(i), source.name(i)), source.label(i)))
        except UnreadableSample:
            if not skip_unreadable:
                raise
    return sorted(out)


def served_digests(batches) -> list[str]:
    return [sample_digest(x.numpy(), y) for xb, yb in batches for x, y in zip(xb, yb.tolist())]


def flip_label_byte(shard_path, position: int) -> None:
    """Flip the low bit of one stored label in the HDF5 file on disk, where HDF5 put it; the manifest is untouched."""
    import h5py

    with h5py.File(shard_path, "r") as f:
        labels = f["labels"]
        c = labels.chunks[0]
        chunk = labels.id.get_chunk_info_by_coord((position // c * c,)).byte_offset
        offset = chunk + (position % c) * labels.dtype.itemsize  # little-endian: the label's low byte
    with open(shard_path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))  # 3 becomes 2: a wrong label that still looks valid


def flip_sample_byte(shard_path, position: int) -> None:
    """Flip one byte of a stored sample in the HDF5 file on disk, in place (same inode, as a failing disk or a
    stray writer would); the manifest is untouched."""
    import h5py

    with h5py.File(shard_path, "r", locking=False) as f:  # the cache may hold it open (without HDF5's lock)
        samples = f["samples"]
        c = samples.chunks[0]
        chunk = samples.id.get_chunk_info_by_coord((position // c * c,) + (0,) * (samples.ndim - 1)).byte_offset
        offset = chunk + (position % c) * samples.dtype.itemsize * int(np.prod(samples.shape[1:]))
    with open(shard_path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
