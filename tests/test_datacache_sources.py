"""datacache sources (image folder, labels.csv, IDX), the preprocessing Pipeline and the IDX -> PNG export (serial)."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from datacache.export import export_fashion_mnist, export_idx_to_png
from datacache.idx import FASHION_ROOT
from datacache.pipeline import Pipeline
from datacache.sources import IdxSource, ImageFolderSource, LabelsCsvSource, UnreadableSample, open_source
from datacache_helpers import write_idx, write_idx_pair

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL = os.path.isfile(os.path.join(FASHION_ROOT, "t10k-labels-idx1-ubyte.gz"))


def gray(seed: int, h: int = 6, w: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w), dtype=np.uint8)


def png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def write_image(path, array: np.ndarray, fmt: str = "PNG") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(array).save(path, format=fmt)


def make_folder(root):
    """cat: 2 images + a note, dog: 1 jpeg (upper-case extension), a loose README at the top."""
    write_image(str(root / "dog" / "a.JPG"), gray(0), "JPEG")
    write_image(str(root / "cat" / "b.png"), gray(1))
    write_image(str(root / "cat" / "a.png"), gray(2))
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / "README").write_text("hello")


def make_csv_dir(root, rows, images=("x.png", "y.png", "z.png")):
    for k, name in enumerate(images):
        write_image(str(root / name), gray(10 + k))
    (root / "labels.csv").write_text("filename,label\n" + "".join(f"{f},{l}\n" for f, l in rows))


# ----------------------------------------------------------------------------- file sources

def test_image_folder_labels_order_and_ignored(tmp_path):
    make_folder(tmp_path)
    src = ImageFolderSource(str(tmp_path))
    assert src.classes == ["cat", "dog"]
    assert len(src) == 3 and src.ignored == 2
    assert [os.path.relpath(src.name(i), tmp_path) for i in range(3)] == ["cat/a.png", "cat/b.png", "dog/a.JPG"]
    assert [src.label(i) for i in range(3)] == [0, 0, 1]
    assert src.labels().tolist() == [0, 0, 1]
    assert Image.open(io.BytesIO(src.raw(2))).format == "JPEG"
    assert "2 classes" in src.describe()
    with pytest.raises(IndexError):
        src.label(3)
    assert isinstance(open_source(str(tmp_path)), ImageFolderSource)


def test_labels_csv_source(tmp_path):
    make_csv_dir(tmp_path, [("y.png", 3), ("x.png", 0)])
    src = LabelsCsvSource(str(tmp_path))
    assert len(src) == 2 and src.unlabelled == 1  # z.png has no row
    assert [os.path.basename(src.name(i)) for i in range(2)] == ["y.png", "x.png"]  # csv order
    assert [src.label(i) for i in range(2)] == [3, 0]
    assert src.raw(1) == (tmp_path / "x.png").read_bytes()
    assert isinstance(open_source(str(tmp_path)), LabelsCsvSource)


def test_file_fingerprints(tmp_path):
    make_folder(tmp_path)
    folder = ImageFolderSource(str(tmp_path))
    fp = folder.fingerprint()
    assert fp == folder.fingerprint() == ImageFolderSource(str(tmp_path)).fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0
    path = tmp_path / "cat" / "a.png"
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched
    fp_touched = folder.fingerprint()
    assert fp_touched != fp
    write_image(str(path), gray(99, 9, 9))  # rewritten with other content
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    assert folder.fingerprint() not in (fp, fp_touched)

    csv_dir = tmp_path / "csv"
    make_csv_dir(csv_dir, [("x.png", 1), ("y.png", 2)])
    fp = LabelsCsvSource(str(csv_dir)).fingerprint()
    assert LabelsCsvSource(str(csv_dir)).fingerprint() == fp
    (csv_dir / "labels.csv").write_text("filename,label\nx.png,1\ny.png,5\n")  # only a label changed
    assert LabelsCsvSource(str(csv_dir)).fingerprint() != fp


def test_file_source_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "cls").mkdir()
    (tmp_path / "empty" / "cls" / "x.txt").write_text("")
    with pytest.raises(ValueError, match="no samples"):
        ImageFolderSource(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="not a recognised dataset layout"):
        open_source(str(tmp_path / "empty" / "cls"))
    with pytest.raises(FileNotFoundError):
        open_source(str(tmp_path / "nowhere"))

    d = tmp_path / "nocsv"
    d.mkdir()
    with pytest.raises(ValueError, match="labels.csv not found"):
        LabelsCsvSource(str(d))
    d = tmp_path / "missing"
    make_csv_dir(d, [("x.png", 0)] + [(f"gone{k}.png", 1) for k in range(7)])
    with pytest.raises(ValueError, match=r"7 listed file\(s\) do not exist.*gone0.png, gone1.png, gone2.png, "
                                         r"gone3.png, gone4.png, \.\.\.$"):
        LabelsCsvSource(str(d))
    d = tmp_path / "badlabel"
    make_csv_dir(d, [("x.png", 0), ("y.png", "cat")])
    with pytest.raises(ValueError, match="line 3: label 'cat' of y.png is not a non-negative integer"):
        LabelsCsvSource(str(d))
    d = tmp_path / "nolabels"
    make_csv_dir(d, [])
    with pytest.raises(ValueError, match="no samples"):
        LabelsCsvSource(str(d))

    make_folder(tmp_path / "gone")
    src = ImageFolderSource(str(tmp_path / "gone"))
    os.remove(tmp_path / "gone" / "cat" / "a.png")
    with pytest.raises(UnreadableSample, match="a.png: cannot read file"):
        src.raw(0)


# ----------------------------------------------------------------------------- IDX

def test_idx_source(tmp_path):
    images, labels = write_idx_pair(tmp_path, n=5)
    src = open_source(str(tmp_path), split="train")
    assert isinstance(src, IdxSource) and len(src) == 5 and src.image_shape == (28, 28)
    np.testing.assert_array_equal(src.raw(3), images[3])
    assert [src.label(i) for i in range(5)] == labels.tolist()
    assert src.name(4) == "idx:train:4"
    fp = src.fingerprint()
    assert fp == IdxSource.fashion_mnist("train", root=str(tmp_path)).fingerprint()
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert src.fingerprint() != fp
    # Plain (not gzip) IDX files are read too.
    plain = tmp_path / "plain-images-idx3-ubyte"
    plain.write_bytes(gzip.decompress((tmp_path / "train-images-idx3-ubyte.gz").read_bytes()))
    np.testing.assert_array_equal(IdxSource(str(plain), str(path)).raw(0), images[0])


@pytest.mark.parametrize("which,magic,dims,payload,match", [
    ("images", 2049, (3, 28, 28), bytes(3 * 784), "bad IDX magic number 0x00000801, expected 0x00000803"),
    ("labels", 2051, (3,), bytes(3), "bad IDX magic number 0x00000803, expected 0x00000801"),
    ("labels", 2049, (4,), bytes(4), "holds 3 images but .* holds 4 labels"),
    ("images", 2051, (0, 28, 28), b"", "holds 0 images but"),
])
def test_idx_errors(tmp_path, which, magic, dims, payload, match):
    write_idx_pair(tmp_path, n=3)
    path = tmp_path / f"train-{which}-idx{3 if which == 'images' else 1}-ubyte.gz"
    write_idx(path, magic, dims, payload)
    with pytest.raises(ValueError, match=match):
        IdxSource.fashion_mnist("train", root=str(tmp_path))


def test_idx_empty_and_truncated(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", 2051, (0, 28, 28), b"")
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", 2049, (0,), b"")
    with pytest.raises(ValueError, match="no samples"):
        IdxSource.fashion_mnist("train", root=str(tmp_path))
    write_idx_pair(tmp_path, n=3)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", 2051, (3, 28, 28), bytes(100))
    src = IdxSource.fashion_mnist("train", root=str(tmp_path))  # the header is consistent: images load lazily
    with pytest.raises(ValueError, match="IDX data truncated"):
        src.raw(0)


@pytest.mark.skipif(not REAL, reason=f"Fashion-MNIST not installed in {FASHION_ROOT}")
def test_real_fashion_mnist():
    for split, n in (("train", 60_000), ("test", 10_000)):
        src = IdxSource.fashion_mnist(split)
        labels = src.labels()
        assert len(src) == n and labels.min() == 0 and labels.max() == 9
        assert src.raw(n - 1).shape == (28, 28)
        assert src.name(n - 1) == f"idx:{split}:{n - 1}"


# ----------------------------------------------------------------------------- pipeline

def test_pipeline_bytes_equal_decoded_array():
    img = gray(5, 28, 28)
    for p in (Pipeline.fashion_mnist(), Pipeline(mode="RGB", resize=14), Pipeline(crop=20, dtype="uint8")):
        a, b = p.apply(png_bytes(img)), p.apply(img)
        assert a.dtype == b.dtype and a.flags.c_contiguous
        np.testing.assert_array_equal(a, b)
    out = Pipeline.fashion_mnist().apply(img)
    assert out.shape == (1, 28, 28) and out.dtype == np.float32
    np.testing.assert_allclose(out[0], (img / 255 - 0.2860) / 0.3530, rtol=1e-5, atol=1e-6)


def test_pipeline_resize_crop_normalize_by_hand():
    rgb = np.random.default_rng(7).integers(0, 256, (10, 20, 3), dtype=np.uint8)
    p = Pipeline(mode="RGB", resize=8, crop=(6, 4), mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.5), dtype="float16")
    out = p.apply(png_bytes(rgb))
    assert out.shape == p.output_shape(rgb) == (3, 6, 4) and out.dtype == np.float16 and out.flags.c_contiguous
    resized = np.asarray(Image.fromarray(rgb).resize((16, 8), Image.Resampling.BILINEAR))  # shorter side 10 -> 8
    crop = resized[1:7, 6:10].transpose(2, 0, 1) / 255.0  # (8-6)//2 = 1, (16-4)//2 = 6
    want = (crop - np.array([0.5, 0.4, 0.3])[:, None, None]) / np.array([0.2, 0.25, 0.5])[:, None, None]
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-3, atol=2e-3)

    g = Pipeline(resize=(5, 7)).apply(gray(3, 10, 20))
    assert g.shape == (1, 5, 7) and 0 <= g.min() and g.max() <= 1
    u = Pipeline(mode="L", crop=4, dtype="uint8").apply(gray(3, 10, 20))
    np.testing.assert_array_equal(u[0], gray(3, 10, 20)[3:7, 8:12])
    # RGB -> L goes through Pillow's luma conversion, whether the input was bytes or an array.
    np.testing.assert_array_equal(Pipeline(dtype="uint8").apply(rgb)[0], np.asarray(Image.fromarray(rgb).convert("L")))
    with pytest.raises(ValueError, match="smaller than the 30x30 crop"):
        Pipeline(crop=30).apply(gray(1))


def test_pipeline_validation():
    with pytest.raises(ValueError, match="cannot be normalized"):
        Pipeline(mean=(0.5,), std=(0.5,), dtype="uint8")
    with pytest.raises(ValueError, match="1 values but the pipeline produces 3"):
        Pipeline(mode="RGB", mean=(0.5,), std=(0.5,))
    with pytest.raises(ValueError, match="both mean and std"):
        Pipeline(mean=(0.5,))
    for bad in (dict(mode="CMYK"), dict(dtype="int32"), dict(resize=0), dict(crop=(3,)), dict(std=(0,), mean=(0,))):
        with pytest.raises(ValueError):
            Pipeline(**bad)


VARIANTS = [dict(), dict(mode="RGB"), dict(resize=32), dict(resize=(32, 30)), dict(crop=24), dict(crop=(24, 20)),
            dict(mean=(0.5,), std=(0.25,)), dict(mean=(0.5,), std=(0.26,)), dict(mean=(0.4,), std=(0.25,)),
            dict(dtype="float16"), dict(dtype="uint8")]


def test_pipeline_hash_and_config():
    hashes = [Pipeline(**v).hash for v in VARIANTS]
    assert len(set(hashes)) == len(VARIANTS)
    for v in VARIANTS:
        p = Pipeline(**v)
        assert len(p.hash) == 16 and Pipeline.from_config(p.config()) == p
        assert Pipeline.from_config(json.loads(json.dumps(p.config()))).hash == p.hash
    cfg = Pipeline.fashion_mnist().config()
    assert cfg["format_version"] == 1 and isinstance(cfg["pillow"], int)
    assert Pipeline(resize=(8, 8)).hash == Pipeline(resize=[8, 8]).hash
    assert Pipeline(mean=[0], std=[1]).hash == Pipeline(mean=(0.0,), std=(1.0,)).hash
    with pytest.raises(ValueError, match="unknown pipeline parameter"):
        Pipeline.from_config(dict(cfg, flip=True))


def test_pipeline_hash_stable_across_processes():
    code = ("from datacache.pipeline import Pipeline; "
            "print(Pipeline.fashion_mnist().hash, Pipeline(mode='RGB', resize=(8, 9), crop=4).hash)")
    outs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED=str(seed))).stdout.split()
            for seed in (1, 2)]
    assert outs[0] == outs[1] == [Pipeline.fashion_mnist().hash, Pipeline(mode="RGB", resize=(8, 9), crop=4).hash]


@pytest.mark.parametrize("data", [png_bytes(gray(4, 16, 16))[:60], b"garbage, not an image", b""])
def test_pipeline_unreadable(data):
    with pytest.raises(UnreadableSample, match="^cat/x.png: cannot decode image") as err:
        Pipeline().apply(data, "cat/x.png")
    assert err.value.where == "cat/x.png"


# ----------------------------------------------------------------------------- export

def test_export_roundtrip(tmp_path):
    images, labels = write_idx_pair(tmp_path, n=4, prefix="train")
    write_idx_pair(tmp_path, n=2, prefix="t10k")
    out = tmp_path / "png"
    assert export_idx_to_png(IdxSource.fashion_mnist("train", root=str(tmp_path)), str(out), "train", False) == 4
    assert export_idx_to_png(IdxSource.fashion_mnist("test", root=str(tmp_path)), str(out), "test", False) == 2
    assert export_idx_to_png(IdxSource.fashion_mnist("train", root=str(tmp_path)), str(out), "train", False) == 4
    assert sorted(os.listdir(out)) == sorted(["labels.csv"] + [f"train-{i:05d}.png" for i in range(4)]
                                             + [f"test-{i:05d}.png" for i in range(2)])
    src = open_source(str(out))
    assert isinstance(src, LabelsCsvSource) and len(src) == 4 and src.unlabelled == 0
    back = {os.path.basename(src.name(i)): i for i in range(len(src))}
    for i in range(4):
        k = back[f"train-{i:05d}.png"]
        assert src.label(k) == labels[i]
        decoded = np.asarray(Image.open(io.BytesIO(src.raw(k))))
        assert decoded.dtype == np.uint8 and decoded.shape == (28, 28)
        np.testing.assert_array_equal(decoded, images[i])
        np.testing.assert_array_equal(Pipeline(dtype="uint8").apply(src.raw(k))[0], images[i])


def test_an_export_trains_on_its_train_split_only(tmp_path):
    """train and test share the export's directory and labels.csv; open_source gives the split asked for."""
    train_images, train_labels = write_idx_pair(tmp_path, n=10, prefix="train")
    write_idx_pair(tmp_path, n=5, prefix="t10k")
    out = str(tmp_path / "png")
    assert export_fashion_mnist(out, root=str(tmp_path), progress=False) == 15
    for split, n in (("train", 10), ("test", 5)):
        src = open_source(out, split)
        names = [os.path.basename(src.name(i)) for i in range(len(src))]
        assert isinstance(src, LabelsCsvSource) and names == [f"{split}-{i:05d}.png" for i in range(n)], names
        assert src.unlabelled == 0 and f"split '{split}'" in src.describe()
    src = open_source(out, "train")
    assert src.labels().tolist() == train_labels.tolist()
    np.testing.assert_array_equal(Pipeline(dtype="uint8").apply(src.raw(3))[0], train_images[3])
    assert open_source(out, "test").fingerprint() != src.fingerprint()  # their caches never mix either
    with pytest.raises(ValueError, match=r"labels.csv: no rows of split 'val'.*'test' \(5 rows\), 'train' \(10"):
        open_source(out, "val")
    with pytest.raises(ValueError, match="no rows of split None"):
        LabelsCsvSource(out)  # a split column and no split asked for: never all rows at once


def test_an_export_before_the_split_column_is_merged_with_its_splits(tmp_path):
    """An older export's labels.csv (filename,label) gets its split from the names; other rows are refused."""
    write_idx_pair(tmp_path, n=3, prefix="t10k")
    out = tmp_path / "png"
    make_csv_dir(out, [("train-00000.png", 1), ("train-00001.png", 2)],
                 images=("train-00000.png", "train-00001.png"))
    assert export_idx_to_png(IdxSource.fashion_mnist("test", root=str(tmp_path)), str(out), "test", False) == 3
    assert len(open_source(str(out), "train")) == 2 and len(open_source(str(out), "test")) == 3
    mine = tmp_path / "mine"
    make_csv_dir(mine, [("x.png", 0)])
    with pytest.raises(ValueError, match=r"files without a split that no export wrote \(e.g. x.png\)"):
        export_idx_to_png(IdxSource.fashion_mnist("test", root=str(tmp_path)), str(mine), "test", False)
    assert len(open_source(str(mine), "test")) == 1  # a labels.csv without splits: all its rows, as before


def test_pipeline_output_is_an_owned_writable_array(tmp_path):
    write_idx_pair(tmp_path, n=2)
    src = IdxSource.fashion_mnist("train", root=str(tmp_path))
    for p in (Pipeline(dtype="uint8"), Pipeline.fashion_mnist()):
        out = p.apply(src.raw(1), src.name(1))
        assert out.flags.writeable and out.flags.owndata
