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


def test_warm_failing_on_one_rank_stops_every_rank_with_one_line(tmp_path):
    """With --on-error fail, a sample that does not decode, or an image of another size, in one rank's part stops
    every rank with one line naming the rank, exit 2: before, a traceback from each rank (an undecodable image),
    or that rank returned alone and the other waited in the job's last collective until killed (another size)."""
    from PIL import Image

    broken = make_png_dataset(tmp_path / "broken", n=24, size=8, garbage=1)
    odd = make_png_dataset(tmp_path / "odd", n=24, size=8)
    Image.new("L", (9, 9)).save(tmp_path / "odd" / "img-0003.png")  # one of the 24 is 9 x 9
    for src, says in ((broken, "broken-0.png"), (odd, "error: rank ")):
        proc = cli("warm", "--source", src, "--cache-dir", str(tmp_path / "c"), "--on-error", "fail", n=2,
                   timeout=150)
        err = proc.stderr
        assert proc.returncode == 2, (src, proc.returncode, err[-2000:])
        assert "Traceback" not in err and err.count("error: rank ") == 1 and says in err, err[-2000:]


def test_clear_leaves_a_held_shard_and_its_temp_files_and_says_so(tmp_path):
    """A shard whose lock a writer holds is left (its manifest's temp file too) and named, the others removed,
    exit 1; before, clear waited, then stopped with a traceback, and took the manifest's temp file for a shard
    of its own name, locked that and deleted the live writer's file."""
    from datacache.shard import shard_lock

    src, cache = make_png_dataset(tmp_path / "png", n=20), tmp_path / "cache"
    assert cli("warm", "--source", src, "--cache-dir", str(cache), n=2).returncode == 0
    held, other = sorted(cache.glob("*.h5"))
    temp = cache / f".{held.name}.json.tmp.12345.abcd"
    temp.write_text("{}")
    with shard_lock(str(held)):  # this process is the writer
        proc = cli("clear", "--cache-dir", str(cache), "--wait", "0.5")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert held.name in proc.stderr and "waiting up to 0.5 s" in proc.stdout
    assert held.exists() and temp.exists() and not other.exists()
    assert cli("clear", "--cache-dir", str(cache)).returncode == 0 and not held.exists() and not temp.exists()


def test_verify_names_a_broken_manifest(tmp_path):
    src, cache = make_png_dataset(tmp_path / "png", n=10), tmp_path / "cache"
    assert cli("warm", "--source", src, "--cache-dir", str(cache)).returncode == 0
    (shard,) = cache.glob("*.h5")
    manifest = shard.with_name(shard.name + ".json")
    manifest.write_text(manifest.read_text() + "}")
    proc = cli("verify", "--cache-dir", str(cache))
    assert proc.returncode == 1 and f"shard manifest {manifest} is not valid JSON" in proc.stdout, proc.stdout
