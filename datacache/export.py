"""Export IDX datasets (Fashion-MNIST) as PNG files plus a labels.csv with a split column, for LabelsCsvSource."""

from __future__ import annotations

import csv
import os
import re
import sys

from PIL import Image

from .idx import FASHION_ROOT
from .sources import IdxSource


def _progress(total: int, desc: str, enabled: bool):
    """A tqdm bar on an interactive terminal, else None (logs and CI would get thousands of redraws)."""
    if not (enabled and sys.stderr.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="img", mininterval=0.5)


_EXPORTED = re.compile(r"(.+)-\d{5}\.png")  # the names this module writes: {prefix}-{i:05d}.png


def _read_rows(csv_path: str) -> list[list[str]]:
    """The rows as [filename, label, split]; an export made before the split column gets it from the names."""
    if not os.path.isfile(csv_path):
        return []
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = [[c.strip() for c in r] for r in csv.reader(f) if r]
    header = rows[0] if rows else []
    if header == ["filename", "label", "split"]:
        return rows[1:]
    if header != ["filename", "label"]:
        raise ValueError(f"{csv_path} exists but does not start with the header 'filename,label,split' "
                         f"(or 'filename,label'); refusing to merge into it")
    legacy = [(r, _EXPORTED.fullmatch(r[0])) for r in rows[1:]]
    alien = [r[0] for r, m in legacy if m is None]
    if alien:
        raise ValueError(f"{csv_path} lists files without a split that no export wrote (e.g. {alien[0]}); "
                         f"refusing to merge into it: export into another directory")
    return [[*r[:2], m.group(1)] for r, m in legacy]


def export_idx_to_png(source: IdxSource, out_dir: str, prefix: str, progress: bool = True) -> int:
    """Write sample i as out_dir/{prefix}-{i:05d}.png (8-bit gray) and list it in out_dir/labels.csv, split `prefix`.

    Rows already in labels.csv for other prefixes are kept, this prefix's rows are replaced, so exporting
    train then test into one directory lists both, told apart by the split column (open_source(dir, split)
    reads one). Returns the number of images written.
    """
    if not prefix or any(c in prefix for c in "/\\,"):
        raise ValueError(f"prefix must be a non-empty file name part without '/', '\\' or ',', got {prefix!r}")
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "labels.csv")
    kept = [r for r in _read_rows(csv_path) if not r[0].startswith(f"{prefix}-")]  # checked before any writing
    bar = _progress(len(source), f"export {prefix}", progress)
    rows = []
    try:
        for i in range(len(source)):
            name = f"{prefix}-{i:05d}.png"
            final = os.path.join(out_dir, name)
            tmp = os.path.join(out_dir, f".{name}.tmp")
            # compress_level=1: for 28x28 images the level barely matters (~115 us per image at 1, 6 or 9,
            # measured); per-file overhead dominates. Level 1 keeps larger images from getting slow.
            Image.fromarray(source.raw(i)).save(tmp, format="PNG", compress_level=1)
            os.replace(tmp, final)  # a crash never leaves a half-written file under the final name
            rows.append([name, str(source.label(i)), prefix])
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    tmp_csv = csv_path + ".tmp"
    with open(tmp_csv, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["filename", "label", "split"])
        writer.writerows(kept + rows)
    os.replace(tmp_csv, csv_path)
    return len(rows)


def export_fashion_mnist(out_dir: str, root: str = FASHION_ROOT, progress: bool = True) -> int:
    """Fashion-MNIST train (split "train", 60,000) and test (split "test", 10,000) into one directory."""
    total = 0
    for split in ("train", "test"):
        total += export_idx_to_png(IdxSource.fashion_mnist(split, root=root), out_dir, split, progress)
    return total
