"""The Jane Austen corpus: fetched with apt for real, read from R's lazy-load format, cut into characters."""

from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from datacache.austen import (BOOKS, PACKAGE, R_DATA, UNKNOWN, CharCorpus, CorpusFetchError, ensure_austen, fetch_deb,
                              load_austen_books, load_austen_text, read_lazyload_db)
from runtime.workloads.sequential import CHAR_VOCAB


@functools.cache
def _apt_candidate() -> bool:
    if shutil.which("apt-cache") is None or shutil.which("dpkg") is None:
        return False
    out = subprocess.run(["apt-cache", "policy", PACKAGE], capture_output=True, text=True).stdout
    return "Candidate:" in out and "Candidate: (none)" not in out


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    """Two fetches racing for one new folder, for real: apt-get download, dpkg -x, the renames into place."""
    if not _apt_candidate():
        pytest.skip(f"apt cannot download {PACKAGE} here (no apt/dpkg, or no apt lists: as root, apt-get update)")
    parent = tmp_path_factory.mktemp("corpus")
    data_dir = str(parent / "janeaustenr")
    os.mkdir(data_dir)  # an empty folder is replaced, as if absent
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(ensure_austen, [data_dir, data_dir]))
    assert paths[0] == paths[1]
    return data_dir, paths[0]


@pytest.fixture(scope="module")
def books(fetched):
    return load_austen_books(fetched[0])


def test_fetch_puts_the_r_data_in_place_and_a_second_call_reuses_it(fetched):
    data_dir, r_data = fetched
    assert r_data == os.path.join(data_dir, R_DATA)
    assert os.path.getsize(os.path.join(r_data, "Rdata.rdb")) > 1_000_000
    assert os.listdir(os.path.dirname(data_dir)) == ["janeaustenr"]  # the loser's copy and temp folders are gone
    inode = os.stat(data_dir).st_ino
    assert ensure_austen(data_dir) == r_data and os.stat(data_dir).st_ino == inode


def test_a_failed_download_names_the_command_and_what_it_said(tmp_path):
    failed = r"`apt-get download mpitrain-no-such-package` failed \(exit \d+\)"
    with pytest.raises(CorpusFetchError, match=failed) as err:
        fetch_deb("mpitrain-no-such-package", str(tmp_path / "tree"))
    assert err.value.command == ["apt-get", "download", "mpitrain-no-such-package"]
    assert "mpitrain-no-such-package" in err.value.stderr and "apt-get update" in str(err.value)
    assert os.listdir(tmp_path) == []


def test_a_folder_holding_something_else_is_refused_before_any_download(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds files but no r-cran-janeaustenr data"):
        ensure_austen(str(tmp_path))
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_six_novels_in_order_of_publication(fetched, books):
    assert list(books) == list(BOOKS.values())
    assert list(books)[:2] == ["Sense & Sensibility", "Pride & Prejudice"]
    pride = books["Pride & Prejudice"]
    assert pride.startswith("PRIDE AND PREJUDICE\n")
    assert "It is a truth universally acknowledged, that a single man in possession\nof a good fortune" in pride
    assert books["Emma"].startswith("EMMA\n") and books["Persuasion"].startswith("Persuasion\n")
    assert all(len(text) > 400_000 for text in books.values())
    text = load_austen_text(fetched[0])
    assert text == "\n\n".join(books.values()) and 3_000_000 < len(text) < 5_000_000
    with pytest.raises(ValueError, match=r"has no \['lizzy'\]"):
        read_lazyload_db(os.path.join(fetched[1], "Rdata"), ["lizzy"])


def test_char_corpus_of_the_novels(books):
    text = "\n\n".join(books.values())
    corpus = CharCorpus(text, seq_len=64, val_fraction=0.1)
    assert corpus.vocab_size == CHAR_VOCAB  # the char-lstm's default vocabulary fits the corpus
    ids = corpus.encode(text)
    assert ids.dtype == torch.int64 and ids.shape == (len(text),) and 0 <= ids.min() and ids.max() < CHAR_VOCAB
    assert int((ids == UNKNOWN).sum()) < 10  # "£" and the like; ASCII otherwise
    x, y = corpus.tensors("train")
    vx, vy = corpus.tensors("val")
    cut = corpus.boundary
    assert cut == round(len(text) * 0.9)
    assert x.shape == y.shape == ((cut - 1) // 64, 64) and x.dtype == y.dtype == torch.int64
    assert vx.shape == vy.shape == ((len(text) - cut - 1) // 64, 64)
    # Windows tile each split in order; targets are the next characters and stay inside the split.
    assert torch.equal(x.flatten(), ids[:x.numel()]) and torch.equal(y.flatten(), ids[1:x.numel() + 1])
    assert x.numel() + 1 <= cut
    assert torch.equal(vx.flatten(), ids[cut:cut + vx.numel()])
    assert torch.equal(vy.flatten(), ids[cut + 1:cut + vx.numel() + 1])
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert corpus.decode(x[0]) == text[:64]
    passage = "It is a truth universally acknowledged, that a single man in possession"
    assert corpus.decode(corpus.encode(passage)) == passage
    assert corpus.decode(corpus.encode("£5\tx")) == "\ufffd5\ufffdx"
    assert math.isclose(len(vx) / (len(x) + len(vx)), 0.1, abs_tol=0.001)


def test_char_corpus_rejects_bad_settings():
    text = "Emma Woodhouse, handsome, clever, and rich"
    with pytest.raises(ValueError, match="val_fraction"):
        CharCorpus(text, val_fraction=1.0)
    with pytest.raises(ValueError, match="no training window"):
        CharCorpus(text, seq_len=64)
    x, y = CharCorpus(text, seq_len=8, val_fraction=0.0).tensors("val")
    assert x.shape == y.shape == (0, 8)
    with pytest.raises(ValueError, match="split must be"):
        CharCorpus(text, seq_len=8).tensors("test")
