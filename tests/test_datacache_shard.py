"""datacache.shard: round trips, atomicity, integrity checks, pickling, write errors and the shard lock."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from datacache.shard import (FORMAT_VERSION, ShardError, ShardLockBusy, ShardReader, ShardWriter, check_writable,
                             manifest_path, shard_lock)
from datacache_helpers import flip_label_byte

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
META = {"pipeline": "p-abc123", "source": "fmnist-train-v1", "partition": [3, 8]}


def samples(n, shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal((n, *shape)).astype(dtype)
    return rng.integers(0, 256, (n, *shape)).astype(dtype)


def write_shard(path, data, ids=None, labels=None, meta=META, **kw):
    n = len(data)
    ids = np.arange(1000, 1000 + n) if ids is None else ids
    labels = np.arange(n) % 10 if labels is None else labels
    with ShardWriter(path, data.shape[1:], data.dtype, meta, **kw) as w:
        half = n // 2
        for i in range(half):  # per-sample appends ...
            w.append(int(ids[i]), int(labels[i]), data[i])
        for s in range(half, n, 77):  # ... and batches that straddle chunk boundaries
            w.append_many(ids[s:s + 77], labels[s:s + 77], data[s:s + 77])
    return ids, labels


def listing(d):
    return sorted(os.listdir(d))


@pytest.mark.parametrize("shape,dtype", [((1, 28, 28), np.float32), ((3, 8, 8), np.uint8)])
def test_round_trip(tmp_path, shape, dtype):
    path = str(tmp_path / "s.h5")
    data = samples(1000, shape, dtype)
    ids, labels = write_shard(path, data)
    assert listing(tmp_path) == ["s.h5", "s.h5.json"]
    m = json.load(open(manifest_path(path)))
    assert m["format_version"] == FORMAT_VERSION and m["count"] == 1000 and m["meta"] == META
    assert m["file_size"] == os.path.getsize(path) and m["sample_shape"] == list(shape)

    r = ShardReader(path, {"pipeline": "p-abc123", "partition": (3, 8)})  # a tuple matches the stored list
    assert len(r) == 1000 and r.sample_shape == shape and r.dtype == np.dtype(dtype)
    assert r.nbytes == data.nbytes
    np.testing.assert_array_equal(r.ids, ids)
    np.testing.assert_array_equal(r.labels, labels)
    rng = np.random.default_rng(1)
    for _ in range(5):
        pos = rng.choice(1000, 256, replace=False)
        np.testing.assert_array_equal(r.read(pos), data[pos])
    pos = [999, 5, 5, 6, 7, 0, 128, 127]  # repeats and runs across a chunk boundary
    np.testing.assert_array_equal(r.read(pos), data[pos])
    out = np.zeros((len(pos), *shape), dtype)
    assert r.read(pos, out=out) is out and np.array_equal(out, data[pos])  # into the caller's memory
    with pytest.raises(ValueError, match="C-contiguous"):
        r.read(pos, out=out[:-1])
    np.testing.assert_array_equal(r.read(np.arange(200, 700)), data[200:700])
    np.testing.assert_array_equal(r.read_all(), data)
    assert r.read([]).shape == (0, *shape)
    assert r.verify() == []
    with pytest.raises(IndexError):
        r.read([1000])
    r.close()
    np.testing.assert_array_equal(r.read([3]), data[[3]])  # reopens after close


def test_lzf_and_small_chunks(tmp_path):
    data = samples(300, (1, 28, 28), np.float32)
    path = str(tmp_path / "c.h5")
    write_shard(path, data, compression="lzf", chunk_samples=64)
    r = ShardReader(path, META)
    pos = np.random.default_rng(2).permutation(300)[:100]
    np.testing.assert_array_equal(r.read(pos), data[pos])
    out = np.empty((100, 1, 28, 28), np.float32)
    np.testing.assert_array_equal(r.read(pos, out=out), data[pos])
    assert np.array_equal(out, data[pos])
    np.testing.assert_array_equal(r.read_all(), data)
    assert r.verify() == []


def test_empty_shard_and_input_checks(tmp_path):
    path = str(tmp_path / "e.h5")
    with ShardWriter(path, (2, 2), np.float32, {}):
        pass
    r = ShardReader(path)
    assert len(r) == 0 and r.read_all().shape == (0, 2, 2) and r.verify() == []
    with ShardWriter(str(tmp_path / "x.h5"), (2, 2), np.uint8, {}) as w:
        with pytest.raises(ValueError, match="shape"):
            w.append(0, 0, np.zeros((2, 3), np.uint8))
        with pytest.raises(TypeError, match="float64"):
            w.append(0, 0, np.zeros((2, 2)))  # float into uint8 would wrap silently
        w.abort()
    with pytest.raises(TypeError, match="JSON"):
        ShardWriter(str(tmp_path / "y.h5"), (2,), np.uint8, {"f": object()})
    assert listing(tmp_path) == ["e.h5", "e.h5.json"]


def test_exception_inside_with_leaves_nothing(tmp_path):
    data = samples(300, (3, 8, 8), np.uint8)
    with pytest.raises(RuntimeError, match="source failed"):
        with ShardWriter(str(tmp_path / "s.h5"), (3, 8, 8), np.uint8, META) as w:
            w.append_many(np.arange(300), np.zeros(300), data)
            raise RuntimeError("source failed")
    assert listing(tmp_path) == []
    with pytest.raises(ShardError) as e:
        ShardReader(str(tmp_path / "s.h5"))
    assert e.value.reason == "missing"


def test_incomplete_and_corrupt_manifest(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, samples(50, (3, 8, 8), np.uint8))
    text = open(manifest_path(path)).read()
    os.unlink(manifest_path(path))  # as if the writer died between the two renames
    with pytest.raises(ShardError, match="no manifest") as e:
        ShardReader(path)
    assert e.value.reason == "incomplete"
    open(manifest_path(path), "w").write(text[: len(text) // 2])
    with pytest.raises(ShardError) as e:
        ShardReader(path)
    assert e.value.reason == "corrupt" and manifest_path(path) in str(e.value)
    # A second writer of the same path replaces both files.
    data = samples(20, (3, 8, 8), np.uint8, seed=5)
    write_shard(path, data)
    np.testing.assert_array_equal(ShardReader(path, META).read_all(), data)


def test_truncated(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, samples(200, (1, 28, 28), np.float32))
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(ShardError, match="bytes") as e:
        ShardReader(path, META)
    assert e.value.reason == "truncated"


def test_flipped_byte_is_found(tmp_path):
    path = str(tmp_path / "s.h5")
    data = samples(400, (1, 28, 28), np.float32)
    write_shard(path, data)
    victim = 137
    with h5py.File(path, "r") as f:  # where HDF5 put that sample's bytes
        ds = f["samples"]
        c = ds.chunks[0]
        offset = ds.id.get_chunk_info_by_coord((victim // c * c, 0, 0, 0)).byte_offset
        offset += (victim % c) * data[0].nbytes + 100
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))
    r = ShardReader(path, META)  # same size: the manifest cannot tell
    with pytest.raises(ShardError, match=f"position.*{victim}") as e:
        r.read([3, victim, 4])
    assert e.value.reason == "corrupt" and e.value.positions == [victim]
    assert r.verify() == [victim]
    with pytest.raises(ShardError):
        r.read_all()
    np.testing.assert_array_equal(r.read([3, 138, 136]), data[[3, 138, 136]])
    assert not np.array_equal(r.read([victim], verify=False), data[[victim]])
    assert pickle.loads(pickle.dumps(e.value)).reason == "corrupt"


def test_flipped_label_byte_is_found(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, samples(300, (3, 8, 8), np.uint8))
    flip_label_byte(path, 201)
    r = ShardReader(path, META)  # same size: the manifest cannot tell
    for look in (lambda: r.labels, r.verify):
        with pytest.raises(ShardError, match="'labels' does not match") as e:
            look()
        assert e.value.reason == "corrupt"


def test_foreign(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, samples(10, (3, 8, 8), np.uint8))
    with pytest.raises(ShardError) as e:
        ShardReader(path, {"pipeline": "p-new999", "source": "fmnist-train-v1", "seed": 4})
    assert e.value.reason == "foreign"
    msg = str(e.value)
    assert "pipeline" in msg and "p-abc123" in msg and "p-new999" in msg and "seed" in msg and "source" not in msg
    m = json.load(open(manifest_path(path)))
    m["format_version"] = FORMAT_VERSION + 1
    json.dump(m, open(manifest_path(path), "w"))
    with pytest.raises(ShardError, match="format_version") as e:
        ShardReader(path, META)
    assert e.value.reason == "foreign"


_inherited = None  # set before a fork: what the forked child reads


def _read_in_child(reader, positions):
    return (reader or _inherited).read(positions)


def test_forked_child_opens_its_own_handles(tmp_path):
    path = str(tmp_path / "s.h5")
    data = samples(300, (3, 8, 8), np.uint8)
    write_shard(path, data)
    r = ShardReader(path, META)
    np.testing.assert_array_equal(r.read([7]), data[[7]])  # handles open before the fork
    global _inherited
    _inherited = r
    with multiprocessing.get_context("fork").Pool(1) as pool:
        got = pool.apply(_read_in_child, (None, [299, 0, 150]))  # the child reads the inherited reader
    np.testing.assert_array_equal(got, data[[299, 0, 150]])
    np.testing.assert_array_equal(r.read([8, 9]), data[[8, 9]])  # the parent's handles still work


def test_file_shrinking_under_an_open_reader(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, samples(300, (1, 28, 28), np.float32))
    r = ShardReader(path, META)
    r.read([0])
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(ShardError) as e:
        r.read([299])
    assert e.value.reason == "truncated"


def test_pickle_and_a_spawned_reader_alongside(tmp_path):
    path = str(tmp_path / "s.h5")
    data = samples(1000, (1, 28, 28), np.float32)
    write_shard(path, data)
    r = ShardReader(path, META)
    np.testing.assert_array_equal(r.read([1, 2]), data[[1, 2]])  # now it holds open handles
    blob = pickle.dumps(r)
    assert len(blob) < 100_000
    r2 = pickle.loads(blob)
    assert r2._h5 is None and r2._fd is None
    np.testing.assert_array_equal(r2.read([999, 0, 500]), data[[999, 0, 500]])
    # One spawned process (the datacache package imports torch: each spawn costs seconds) reads while
    # this one keeps reading the same file through its own handles.
    rng = np.random.default_rng(3)
    jobs = [rng.choice(1000, 256, replace=False) for _ in range(20)]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pending = pool.starmap_async(_read_in_child, [(r2, pos) for pos in jobs])
        while not pending.ready():
            pos = rng.choice(1000, 256, replace=False)
            np.testing.assert_array_equal(r.read(pos), data[pos])
        for pos, got in zip(jobs, pending.get(timeout=60)):
            np.testing.assert_array_equal(got, data[pos])


def test_write_errors_name_the_directory(tmp_path):
    afile = tmp_path / "plain"
    afile.write_text("")
    for d, kind in ((afile, NotADirectoryError), (tmp_path / "nope", FileNotFoundError)):
        with pytest.raises(kind) as e:
            ShardWriter(str(d / "s.h5"), (2,), np.uint8, {})
        assert str(d) in str(e.value) and "shard s.h5" in str(e.value)
        assert check_writable(d) is not None
    assert "not a directory" in check_writable(afile) and "does not exist" in check_writable(tmp_path / "nope")
    assert check_writable(tmp_path) is None and listing(tmp_path) == ["plain"]
    assert check_writable("/proc") is not None  # a directory, but no regular files can be created there
    assert "MiB free" in check_writable(tmp_path, min_free_bytes=1 << 62)


# Subprocesses import datacache.shard under a bare package: the real datacache/__init__ imports torch (seconds).
_LOAD_SHARD = f"""
import importlib, sys, types
_pkg = types.ModuleType("datacache")
_pkg.__path__ = [{os.path.join(ROOT, "datacache")!r}]
sys.modules["datacache"] = _pkg
shard = importlib.import_module("datacache.shard")
"""

_NAMESPACE_SCRIPT = _LOAD_SHARD + r"""
import errno, json, os, sys
import numpy as np
ShardWriter, check_writable = shard.ShardWriter, shard.check_writable
full, ro = sys.argv[1], sys.argv[2]
out = {}
try:
    with ShardWriter(os.path.join(full, "s.h5"), (1, 28, 28), np.float32, {}) as w:
        w.append_many(np.arange(1000), np.zeros(1000), np.ones((1000, 1, 28, 28), np.float32))
except OSError as e:
    out["full"] = [type(e).__name__, e.errno, str(e), sorted(os.listdir(full))]
try:
    ShardWriter(os.path.join(ro, "s.h5"), (2,), np.uint8, {})
except OSError as e:
    out["ro"] = [type(e).__name__, e.errno, str(e), sorted(os.listdir(ro))]
out["ro_check"] = check_writable(ro)
print(json.dumps(out))
"""


def test_disk_full_and_read_only_in_a_private_mount_namespace(tmp_path):
    """ENOSPC and EROFS for real: small tmpfs mounts that exist only inside `unshare -m`."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to mount a private tmpfs")
    full, ro = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    ro.mkdir()
    script = tmp_path / "ns.py"
    script.write_text(_NAMESPACE_SCRIPT)
    shell = (f"mount -t tmpfs -o size=2m tmpfs {full} && mount -t tmpfs -o ro,size=64k tmpfs {ro} && "
             f"exec {sys.executable} {script} {full} {ro}")
    p = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=60)
    if p.returncode != 0 and "mount" in p.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    name, code, msg, left = out["full"]
    assert code == errno.ENOSPC and str(full) in msg and left == [], out
    name, code, msg, left = out["ro"]
    assert code == errno.EROFS and str(ro) in msg and left == [], out
    assert "read-only" in out["ro_check"]


def test_shard_lock(tmp_path):
    path = str(tmp_path / "s.h5")
    with shard_lock(path) as lock_path:
        assert open(lock_path).read().startswith(os.uname().nodename)
        # flock locks belong to the open file description: a second open conflicts even in this process.
        with pytest.raises(ShardLockBusy, match="pid") as e:
            with shard_lock(path, blocking=False):
                pass
        assert isinstance(e.value, TimeoutError) and isinstance(e.value, BlockingIOError)
        t = time.monotonic()
        with pytest.raises(TimeoutError, match="0.2s"):
            with shard_lock(path, timeout=0.2):
                pass
        assert time.monotonic() - t >= 0.2
    with shard_lock(path, blocking=False):
        pass  # free again
    assert os.path.exists(path + ".lock")  # kept on purpose: removing it races with waiters


def test_lock_waits_for_another_process(tmp_path):
    path = str(tmp_path / "s.h5")
    holder = subprocess.Popen([sys.executable, "-c", _LOAD_SHARD + (
        f"import time\nwith shard.shard_lock({path!r}):\n    print('held', flush=True); time.sleep(0.5)\n"
        "print('released')")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ShardLockBusy):
        with shard_lock(path, blocking=False):
            pass
    with shard_lock(path, timeout=10):  # waits for the holder to finish
        assert holder.stdout.readline().strip() == "released"
    assert holder.wait() == 0
