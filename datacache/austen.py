"""Jane Austen's six novels from Debian's r-cran-janeaustenr, and a character-level corpus of them for the char-LSTM."""

from __future__ import annotations

import bz2
import glob
import lzma
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib

import numpy as np

PACKAGE = "r-cran-janeaustenr"
# Where the package keeps its data sets, below the root it is extracted into (dpkg -x).
R_DATA = os.path.join("usr", "lib", "R", "site-library", "janeaustenr", "data")
# R object name -> title (janeaustenr's austen_books() names), in order of publication.
BOOKS = {"sensesensibility": "Sense & Sensibility", "prideprejudice": "Pride & Prejudice",
         "mansfieldpark": "Mansfield Park", "emma": "Emma", "northangerabbey": "Northanger Abbey",
         "persuasion": "Persuasion"}
# Character ids: 0 any other character (a few, e.g. "£"), then newline and printable ASCII. Id 0 is
# runtime's PAD, which the token loss does not score. runtime.workloads.sequential.CHAR_VOCAB == 97.
CHARS = "\n" + "".join(map(chr, range(32, 127)))
UNKNOWN = 0


class CorpusFetchError(RuntimeError):
    """A command fetching the corpus failed: .command is what ran, .stderr the end of what it said."""

    def __init__(self, command: list[str], stderr: str, why: str = "failed"):
        self.command, self.stderr = command, stderr
        super().__init__(f"`{' '.join(command)}` {why}: {stderr.strip()[-800:] or '(no output)'}\n"
                         f"{PACKAGE} comes from Debian's apt sources: as root, `apt-get update` may be what is missing")


def default_data_dir() -> str:
    """$MPITRAIN_DATA_DIR/janeaustenr, or ~/.cache/mpitrain/janeaustenr."""
    root = os.environ.get("MPITRAIN_DATA_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mpitrain")
    return os.path.join(root, "janeaustenr")


def _has_data(root: str) -> bool:
    return all(os.path.isfile(os.path.join(root, R_DATA, f"Rdata.{ext}")) for ext in ("rdb", "rdx"))


def _run(command: list[str], cwd: str | None = None) -> None:
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        raise CorpusFetchError(command, "", "cannot run: command not found (not a Debian system?)") from None
    except subprocess.TimeoutExpired as exc:
        raise CorpusFetchError(command, (exc.stderr or b"").decode(errors="replace"), "timed out") from None
    if done.returncode != 0:
        raise CorpusFetchError(command, done.stderr, f"failed (exit {done.returncode})")


def fetch_deb(package: str, dest: str) -> None:
    """Download Debian `package` (no root needed, only apt lists) and extract its files below the new folder dest."""
    with tempfile.TemporaryDirectory(prefix=".download.", dir=os.path.dirname(dest)) as download:
        _run(["apt-get", "download", package], cwd=download)
        debs = glob.glob(os.path.join(download, "*.deb"))
        if len(debs) != 1:
            raise CorpusFetchError(["apt-get", "download", package], f"left {len(debs)} .deb files, expected 1")
        _run(["dpkg", "-x", debs[0], dest])


def ensure_austen(data_dir: str | None = None) -> str:
    """The folder holding janeaustenr's Rdata.rdb/.rdx below data_dir (default_data_dir()), fetched if absent.

    The package is extracted into a temporary sibling of data_dir, then renamed into place: the
    rename is atomic, so a reader never sees half a tree, and of two processes fetching at once
    one rename wins and the other keeps the winner's copy.
    """
    data_dir = os.path.abspath(data_dir or default_data_dir())
    if _has_data(data_dir):
        return os.path.join(data_dir, R_DATA)
    if os.path.isdir(data_dir) and os.listdir(data_dir):
        raise FileExistsError(f"{data_dir} holds files but no {PACKAGE} data: remove it or pick another data_dir")
    parent = os.path.dirname(data_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(data_dir)}.", dir=parent)
    try:
        tree = os.path.join(tmp, "tree")
        fetch_deb(PACKAGE, tree)
        if not _has_data(tree):
            raise CorpusFetchError(["dpkg", "-x", PACKAGE, tree], f"extracted no {R_DATA}/Rdata.rdb and .rdx")
        try:
            os.rename(tree, data_dir)  # replaces an empty folder too
        except OSError:
            if not _has_data(data_dir):  # not a faster process's copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(data_dir, R_DATA)


def read_lazyload_db(base: str, names=None) -> dict:
    """Objects of an R lazy-load database (base.rdx + base.rdb), converted by the rdata library.

    R packages install their data sets this way rather than as .rda files, and rdata reads only
    whole serializations, so the database is taken apart here (R's makeLazyLoadDB and
    lazyLoadDBfetch): the .rdx is a gzipped RDS of list(variables = name -> c(offset, length),
    references, compressed); each [offset, offset + length) of the .rdb is one serialization,
    compressed: TRUE/1 = 4-byte big-endian size + zlib; 2 or 3 = size + a type byte ('Z' zlib,
    '2' bzip2, 'X' xz, '0' stored) + data; FALSE = plain. A serialization without the RDS file's
    magic is what rdata calls RDS, hence extension=".rds".
    """
    import rdata  # heavy (pandas, xarray): only when the corpus is read

    def parse(raw: bytes):
        return rdata.conversion.convert(rdata.parser.parse_data(raw, extension=".rds"))

    with open(base + ".rdx", "rb") as f:
        index = parse(f.read())
    how = int(np.asarray(index["compressed"]).ravel()[0])
    variables = index["variables"]
    missing = [n for n in (names or ()) if n not in variables]
    if missing:
        raise ValueError(f"{base}.rdb has no {missing}; it holds {sorted(variables)}")
    objects = {}
    with open(base + ".rdb", "rb") as f:
        for name in names or variables:
            offset, length = (int(v) for v in variables[name])
            f.seek(offset)
            blob = f.read(length)
            objects[str(name)] = parse(_decompress(blob, how, f"{base}.rdb[{name}]"))
    return objects


def _decompress(blob: bytes, how: int, where: str) -> bytes:
    if how == 0:
        return blob
    size = struct.unpack(">I", blob[:4])[0]
    kind, body = (b"Z", blob[4:]) if how == 1 else (blob[4:5], blob[5:])
    unpack = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress, b"0": bytes}.get(kind)
    if unpack is None:
        raise ValueError(f"{where}: unknown compression type {kind!r} (compressed={how})")
    raw = unpack(body)
    if len(raw) != size:
        raise ValueError(f"{where}: {len(raw)} bytes decompressed, the header says {size}")
    return raw


def load_austen_books(data_dir: str | None = None) -> dict[str, str]:
    """Title -> text of each novel (its lines joined with newlines), in order of publication."""
    objects = read_lazyload_db(os.path.join(ensure_austen(data_dir), "Rdata"), BOOKS)
    # Each novel is a character vector, one element per line of the Project Gutenberg text.
    return {title: "\n".join("" if line is None else str(line) for line in objects[name])
            for name, title in BOOKS.items()}


def load_austen_text(data_dir: str | None = None) -> str:
    """The six novels in order of publication, one text, a blank line between novels (about 4.0 M characters)."""
    return "\n\n".join(load_austen_books(data_dir).values())


class CharCorpus:
    """A text as character ids: the first 1 - val_fraction of it for training, the rest for validation.

    tensors(split) cuts a split into non-overlapping windows x [N, seq_len] with targets y = the
    next characters; a split's windows and targets lie inside it, so no character of one split is
    input or target in the other.
    """

    vocab_size = len(CHARS) + 1

    def __init__(self, text: str, seq_len: int = 64, val_fraction: float = 0.1):
        if seq_len < 1 or not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"need seq_len >= 1 and 0 <= val_fraction < 1, got {seq_len}, {val_fraction}")
        self.seq_len = seq_len
        ids = self.encode(text)
        self.boundary = round(len(ids) * (1.0 - val_fraction))  # first validation character
        if self.boundary <= seq_len:
            raise ValueError(f"a text of {len(ids)} characters leaves no training window of {seq_len} + 1")
        self._splits = {"train": ids[:self.boundary], "val": ids[self.boundary:]}

    @staticmethod
    def encode(text: str):
        """int64 tensor [len(text)] of character ids (UNKNOWN for characters outside CHARS)."""
        import torch  # here, not on top: `python -P datacache/austen.py` (make setup) needs no torch

        table = np.full(128, UNKNOWN, dtype=np.int64)
        table[[ord(c) for c in CHARS]] = np.arange(1, len(CHARS) + 1)
        codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        return torch.from_numpy(np.where(codes < 128, table[np.minimum(codes, 127)], UNKNOWN))

    @staticmethod
    def decode(ids) -> str:
        """The text of character ids; UNKNOWN reads as U+FFFD."""
        chars = np.array(["\ufffd", *CHARS])
        return "".join(chars[np.asarray(ids, dtype=np.int64).ravel()])

    def tensors(self, split: str = "train"):
        """(x, y) int64 [N, seq_len], y[i, t] the character after x[i, t]; split "train" or "val"."""
        if split not in self._splits:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        ids, t = self._splits[split], self.seq_len
        n = max(0, (len(ids) - 1) // t)
        return ids[:n * t].view(n, t), ids[1:n * t + 1].view(n, t)


if __name__ == "__main__":  # make setup: python -P datacache/austen.py (-P: this folder not on sys.path)
    try:
        print(ensure_austen())
    except (CorpusFetchError, OSError) as exc:
        sys.exit(f"error: {exc}")
