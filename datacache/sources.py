"""Where raw samples come from: image folders, a directory with labels.csv, or IDX files (Fashion-MNIST)."""

from __future__ import annotations

import csv
import glob
import hashlib
import json
import operator
import os
import threading

import numpy as np

from .idx import FASHION_ROOT, fashion_mnist_files, read_data, read_labelled

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


class UnreadableSample(Exception):
    """A sample whose bytes cannot be read or decoded; `where` names it (path or idx:...), `reason` says why."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


class Source:
    """Indexable raw samples: len(), raw(i), label(i), name(i), plus a cheap content fingerprint."""

    def __len__(self) -> int:
        raise NotImplementedError

    def raw(self, i: int) -> bytes | np.ndarray:
        """Encoded image bytes (file sources) or an already decoded uint8 HxW array (IDX)."""
        raise NotImplementedError

    def label(self, i: int) -> int:
        raise NotImplementedError

    def name(self, i: int) -> str:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """Short hex digest that changes when the content (probably) changed, computed from metadata only."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{type(self).__name__}: {len(self)} samples"

    def labels(self) -> np.ndarray:
        """All labels as int64 [N]."""
        return np.array([self.label(i) for i in range(len(self))], dtype=np.int64)

    def _index(self, i) -> int:
        i = operator.index(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        return i

    def __repr__(self) -> str:
        return f"<{self.describe()}>"


class _FileSource(Source):
    """Samples that are image files under `root`, each with a label; subclasses fill _files and _labels."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"{type(self).__name__}: {root} is not a directory")
        self._files: list[str] = []  # paths relative to root, '/'-separated
        self._labels: list[int] = []

    def _require_samples(self, layout: str) -> None:
        if not self._files:
            raise ValueError(f"{type(self).__name__}: no samples in {self.root} (expected {layout})")

    def __len__(self) -> int:
        return len(self._files)

    def path(self, i: int) -> str:
        return os.path.join(self.root, self._files[self._index(i)])

    def raw(self, i: int) -> bytes:
        path = self.path(i)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise UnreadableSample(path, f"cannot read file ({e.strerror or e})") from e

    def label(self, i: int) -> int:
        return self._labels[self._index(i)]

    def labels(self) -> np.ndarray:
        return np.array(self._labels, dtype=np.int64)

    def name(self, i: int) -> str:
        return self.path(i)

    def fingerprint(self) -> str:
        # Stat at call time, not at construction: the point is to notice files rewritten since a cache was built.
        entries = []
        for rel, lab in zip(self._files, self._labels):
            try:
                st = os.stat(os.path.join(self.root, rel))
                entries.append([rel, st.st_size, st.st_mtime_ns, lab])
            except OSError:
                entries.append([rel, -1, -1, lab])  # vanished: still a different fingerprint, not a crash
        return _digest([type(self).__name__, entries])


class ImageFolderSource(_FileSource):
    """root/<class_name>/<image files>: classes sorted by name get labels 0..C-1; non-image files are counted in `ignored`."""

    def __init__(self, root: str):
        super().__init__(root)
        with os.scandir(self.root) as it:
            top = list(it)
        # Hidden directories (.git, .ipynb_checkpoints) are tooling, not classes.
        self.classes = sorted(e.name for e in top if e.is_dir() and not e.name.startswith("."))
        self.ignored = sum(1 for e in top if e.is_file())  # loose files belong to no class
        for label, cls in enumerate(self.classes):
            for entry in sorted(os.scandir(os.path.join(self.root, cls)), key=lambda e: e.name):
                if entry.is_file() and _is_image(entry.name):
                    self._files.append(f"{cls}/{entry.name}")
                    self._labels.append(label)
                elif entry.is_file():
                    self.ignored += 1
        self._require_samples("class subdirectories holding " + "/".join(IMAGE_EXTENSIONS) + " files")

    def describe(self) -> str:
        return (f"ImageFolderSource {self.root}: {len(self)} samples in {len(self.classes)} classes"
                f" ({self.ignored} non-image files ignored)")


class LabelsCsvSource(_FileSource):
    """A directory of images plus labels.csv (`filename,label[,split]`); rows keep csv order, unlisted images count
    in `unlabelled`. With a split column (as `mpitrain cache export` writes) only the rows of `split` are samples."""

    def __init__(self, root: str, csv_path: str | None = None, split: str | None = None):
        super().__init__(root)
        self.csv_path = os.path.abspath(csv_path or os.path.join(self.root, "labels.csv"))
        if not os.path.isfile(self.csv_path):
            raise ValueError(f"LabelsCsvSource: label file {self.csv_path} not found "
                             f"(expected a csv with header 'filename,label')")
        present = set()
        for dirpath, _, names in os.walk(self.root):
            rel_dir = os.path.relpath(dirpath, self.root)
            for n in names:
                present.add(os.path.normpath(os.path.join(rel_dir, n)).replace(os.sep, "/"))
        seen, missing, splits = {}, [], {}
        with open(self.csv_path, newline="", encoding="utf-8-sig") as f:  # -sig: spreadsheets prepend a BOM
            reader = csv.reader(f)
            header = [h.strip() for h in next(reader, [])]
            if header not in (["filename", "label"], ["filename", "label", "split"]):
                raise ValueError(f"{self.csv_path}: header must be 'filename,label' or 'filename,label,split', "
                                 f"found {','.join(header)!r}")
            for row in reader:
                line = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != len(header):
                    raise ValueError(f"{self.csv_path} line {line}: expected {len(header)} columns "
                                     f"{','.join(header)!r}, got {row}")
                rel, text = os.path.normpath(row[0].strip()).replace(os.sep, "/"), row[1].strip()
                try:
                    label = int(text)
                except ValueError:
                    label = -1
                if label < 0:
                    raise ValueError(f"{self.csv_path} line {line}: label {text!r} of {rel} is not a non-negative integer")
                if rel in seen:
                    raise ValueError(f"{self.csv_path} line {line}: {rel} is listed again (first at line {seen[rel]})")
                seen[rel] = line
                if len(row) == 3:  # another split's rows are neither samples nor unlabelled images
                    part = row[2].strip()
                    splits[part] = splits.get(part, 0) + 1
                    if part != split:
                        continue
                if rel not in present:
                    missing.append(rel)
                self._files.append(rel)
                self._labels.append(label)
        # A split column means the rows belong to different uses (train, test): never mix them silently.
        self.split = split if len(header) == 3 else None
        if len(header) == 3 and split not in splits:
            have = ", ".join(f"{k!r} ({v} rows)" for k, v in sorted(splits.items())) or "none"
            raise ValueError(f"{self.csv_path}: no rows of split {split!r} in its split column (splits: {have}); "
                             f"pass one of them as the split")
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(f"{self.csv_path}: {len(missing)} listed file(s) do not exist under {self.root}: {shown}")
        self.unlabelled = sum(1 for p in present if _is_image(p) and p not in seen)
        self._require_samples(f"rows in {self.csv_path}")

    def describe(self) -> str:
        part = "" if self.split is None else f" split {self.split!r}"
        return (f"LabelsCsvSource {self.root}{part}: {len(self)} samples, {len(set(self._labels))} distinct labels"
                f" ({self.unlabelled} images without a label)")


class IdxSource(Source):
    """Images and labels from a pair of IDX files (plain or gzip); images are decompressed on first raw()."""

    def __init__(self, images_path: str, labels_path: str, tag: str | None = None):
        self.images_path, self.labels_path = os.path.abspath(images_path), os.path.abspath(labels_path)
        self.tag = tag or os.path.basename(images_path).split("-")[0]
        # Labels are small: read now. Images (47 MB for Fashion-MNIST) wait until needed, so that
        # open + fingerprint stays cheap when a cache already holds the preprocessed samples.
        self._dims, self._labels = read_labelled(self.images_path, self.labels_path)
        self._images = None
        self._lock = threading.Lock()

    @classmethod
    def fashion_mnist(cls, split: str = "train", root: str = FASHION_ROOT) -> "IdxSource":
        return cls(*fashion_mnist_files(split, root), tag=split)

    @property
    def image_shape(self) -> tuple[int, int]:
        return self._dims[1], self._dims[2]

    def _all_images(self) -> np.ndarray:
        if self._images is None:
            with self._lock:  # prefetch threads may ask at once; decompress only once
                if self._images is None:
                    self._images = read_data(self.images_path, self._dims)
        return self._images

    def __getstate__(self):
        # Worker processes reload the images themselves rather than receive 47 MB pickled.
        state = dict(self.__dict__, _images=None)
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def __len__(self) -> int:
        return len(self._labels)

    def raw(self, i: int) -> np.ndarray:
        return self._all_images()[self._index(i)]

    def label(self, i: int) -> int:
        return int(self._labels[self._index(i)])

    def labels(self) -> np.ndarray:
        return self._labels.astype(np.int64)

    def name(self, i: int) -> str:
        return f"idx:{self.tag}:{self._index(i)}"

    def fingerprint(self) -> str:
        entries = []
        for p in (self.images_path, self.labels_path):
            st = os.stat(p)
            entries.append([p, st.st_size, st.st_mtime_ns])
        return _digest(["IdxSource", entries])

    def describe(self) -> str:
        h, w = self.image_shape
        return f"IdxSource {self.tag} ({self.images_path}): {len(self)} samples of {h}x{w}"


def open_source(path: str, split: str = "train") -> Source:
    """Pick the source for a directory by its layout; `split` picks IDX files, or a labels.csv's rows by its split
    column (an export holds train and test); a labels.csv without that column has no splits: all its rows."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset path {path} does not exist")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "labels.csv")):
            return LabelsCsvSource(path, split=split)
        if glob.glob(os.path.join(glob.escape(path), "*-idx3-ubyte*")):
            return IdxSource.fashion_mnist(split, root=path)
        with os.scandir(path) as it:
            has_subdirs = any(e.is_dir() and not e.name.startswith(".") for e in it)
        if has_subdirs:
            return ImageFolderSource(path)
    raise ValueError(f"{path}: not a recognised dataset layout; expected a directory holding either "
                     f"labels.csv (filename,label[,split]) next to the images, or IDX files "
                     f"(train-/t10k-images-idx3-ubyte[.gz] with labels-idx1-ubyte), or one subdirectory "
                     f"per class with the images inside (root/<class>/<image>)")
