"""jobs.cache: warm under mpiexec, info, verify (finds a corrupted shard), clear, export, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py

from conftest import ROOT
from datacache_helpers import make_png_dataset
from mpicomm.launch import mpiexec


def cli(*args, n=None, timeout=180):
    cmd = ([mpiexec(), "-n", str(n)] if n else []) + [sys.executable, "-m", "jobs.cache", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_warm_info_verify_clear(tmp_path):
    src, cache = make_png_dataset(tmp_path / "png", n=40), str(tmp_path / "cache")
    proc = cli("warm", "--source", src, "--cache-dir", cache, n=2)
    assert proc.returncode == 0 and proc.stdout.count("cold -> warm") == 2, proc.stderr[-2000:]
    again = cli("warm", "--source", src, "--cache-dir", cache, n=2)
    assert again.stdout.count("warm -> warm") == 2  # nothing rebuilt
    rows = json.loads(cli("info", "--cache-dir", cache, "--json").stdout)
    assert len(rows) == 2 and sum(r["samples"] for r in rows) == 40 and all(r["meta"]["ranks"] == 2 for r in rows)
    assert cli("verify", "--cache-dir", cache).returncode == 0
    shard = sorted((tmp_path / "cache").glob("*.h5"))[0]
    with h5py.File(shard, "r+") as f:
        f["samples"][3] = f["samples"][3] * 2 + 1
    bad = cli("verify", "--cache-dir", cache, "--remove-bad")
    assert bad.returncode == 1 and "corrupt" in bad.stdout and not shard.exists()
    assert cli("clear", "--cache-dir", cache).returncode == 0 and not list((tmp_path / "cache").glob("*.h5"))


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = cli("warm", "--source", str(empty), "--cache-dir", str(tmp_path / "c"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    missing = cli("info", "--cache-dir", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: --cache-dir: ")
    assert "does not exist" in missing.stderr
