"""SampleCache in one process: exact samples, exactly once, recovery from bad shards, fallbacks, workers."""

from __future__ import annotations

import glob
import json
import os

import h5py
import numpy as np
import pytest
import torch

from datacache import CachedDataset, EpochBatchSampler, Pipeline, SampleCache
from datacache.shard import shard_lock
from datacache.sources import LabelsCsvSource, UnreadableSample
from datacache_helpers import flip_label_byte, flip_sample_byte, fresh_digests, make_png_dataset, served_digests

PIPE = Pipeline(mode="L", mean=(0.5,), std=(0.25,))


@pytest.fixture
def source(tmp_path):
    return LabelsCsvSource(make_png_dataset(tmp_path / "src"))


def cache(source, tmp_path, rank=0, ranks=1, **kw):
    kw.setdefault("log", lambda *a: None)
    return SampleCache(source, kw.pop("pipeline", PIPE), str(tmp_path / "cache"), rank, ranks, **kw)


def epoch(c, e, batch=10):
    return list(c.batches(e, batch))


def test_cold_then_warm_serve_fresh_preprocessing_byte_for_byte(source, tmp_path):
    c = cache(source, tmp_path)
    assert c.state == "cold"
    want = fresh_digests(source, PIPE)
    assert sorted(served_digests(epoch(c, 0))) == want and c.stats.from_source == len(source)
    assert c.state == "warm"
    assert sorted(served_digests(epoch(c, 1))) == want and c.stats.from_memory == len(source)
    again = cache(source, tmp_path)  # a new job finds the shard
    assert again.state == "warm" and sorted(served_digests(epoch(again, 2))) == want


def test_batches_are_tensors_cold_and_warm(source, tmp_path):
    """The cache holds numpy arrays (warming a shard imports no torch); training gets tensors, float32 and int64."""
    c = cache(source, tmp_path)
    for e in range(2):  # cold (decoded from the source), then warm (read back)
        for x, y in epoch(c, e):
            assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), (type(x), type(y))
            assert (x.dtype, y.dtype) == (torch.float32, torch.int64) and len(x) == len(y) > 0


def test_shard_level_when_memory_is_small(source, tmp_path):
    cache(source, tmp_path).warm()
    c = cache(source, tmp_path, memory_bytes=20 * 64 * 4)  # 20 samples of 8x8 float32
    assert sorted(served_digests(epoch(c, 0))) == fresh_digests(source, PIPE)
    assert c.stats.from_memory == 20 and c.stats.from_shard == len(source) - 20


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_exactly_once_per_epoch_across_ranks_with_equal_steps(source, tmp_path, ranks):
    parts = [cache(source, tmp_path, r, ranks) for r in range(ranks)]
    for e in range(2):  # cold, then warm
        batches = [epoch(c, e, batch=16) for c in parts]
        assert len({len(b) for b in batches}) == 1  # every rank runs the same number of steps
        assert sorted(d for b in batches for d in served_digests(b)) == fresh_digests(source, PIPE)
    orders = [torch.cat([x for x, _ in epoch(parts[0], e, 16)]) for e in (2, 3)]
    assert not torch.equal(orders[0], orders[1])  # reshuffled every epoch


def test_corrupt_sample_is_never_served_and_the_shard_is_rebuilt(source, tmp_path):
    c = cache(source, tmp_path, memory_bytes=0)
    c.warm()
    c.close()
    with h5py.File(c.path, "r+") as f:  # change one stored sample behind the manifest's back
        f["samples"][5] = f["samples"][5] + 1.0
    c = cache(source, tmp_path, memory_bytes=0)
    assert sorted(served_digests(epoch(c, 0))) == fresh_digests(source, PIPE)
    assert any("invalid" in e for e in c.stats.events)
    epoch(c, 1)  # rebuilds
    assert c.state == "warm" and cache(source, tmp_path).reader.verify() == []


@pytest.mark.parametrize("memory_bytes", [0, 256 << 20])  # labels of shard reads and of memory hits
def test_a_corrupt_label_is_never_served_and_the_shard_is_rebuilt(source, tmp_path, memory_bytes):
    c = cache(source, tmp_path, memory_bytes=memory_bytes)
    c.warm()
    c.close()
    flip_label_byte(c.path, 5)
    want = fresh_digests(source, PIPE)  # a digest covers the label
    c = cache(source, tmp_path, memory_bytes=memory_bytes)
    for e in range(3):  # from the source while the shard is rebuilt, then from the new shard
        assert sorted(served_digests(epoch(c, e))) == want, f"epoch {e}"
    assert any("invalid" in e for e in c.stats.events) and c.state == "warm"
    rebuilt = cache(source, tmp_path).reader
    assert rebuilt.verify() == [] and rebuilt.labels.tolist() == [source.label(int(i)) for i in rebuilt.ids]


def test_stats_count_each_served_sample_where_it_came_from(source, tmp_path):
    """A shard read that fails mid-epoch counts its batch once, as served from the source."""
    c = cache(source, tmp_path)
    c.warm()
    c.close()
    with h5py.File(c.path, "r+") as f:  # beyond the 20 samples held in memory: found mid-epoch
        f["samples"][90] = f["samples"][90] + 1.0
    c = cache(source, tmp_path, memory_bytes=20 * 64 * 4)
    served = served_digests(epoch(c, 0))
    s = c.stats
    assert any("invalid" in e for e in s.events) and sorted(served) == fresh_digests(source, PIPE)
    assert (s.from_memory, s.from_shard, s.from_source) != (0, 0, 0)
    assert s.from_memory + s.from_shard + s.from_source == len(served), (s.from_memory, s.from_shard, s.from_source)


@pytest.mark.parametrize("damage", ["truncate", "foreign", "no-manifest"])
def test_damaged_or_foreign_shards_are_rebuilt(source, tmp_path, damage):
    c = cache(source, tmp_path)
    c.warm()
    c.close()
    if damage == "truncate":
        with open(c.path, "r+b") as f:
            f.truncate(os.path.getsize(c.path) - 100)
    elif damage == "foreign":
        manifest = json.load(open(c.path + ".json"))
        manifest["meta"]["partition_seed"] = 99
        json.dump(manifest, open(c.path + ".json", "w"))
    else:
        os.remove(c.path + ".json")
    d = cache(source, tmp_path)
    assert d.state == "cold" and any("not used" in e for e in d.stats.events)
    assert sorted(served_digests(epoch(d, 0))) == fresh_digests(source, PIPE) and d.state == "warm"


def test_changed_pipeline_never_serves_stale_samples(source, tmp_path):
    cache(source, tmp_path).warm()
    other = Pipeline(mode="L")
    c = cache(source, tmp_path, pipeline=other)
    assert c.state == "cold" and sorted(served_digests(epoch(c, 0))) == fresh_digests(source, other)
    assert len(glob.glob(str(tmp_path / "cache" / "*.h5"))) == 2


def test_unreadable_files_are_skipped_with_a_count(tmp_path):
    src = LabelsCsvSource(make_png_dataset(tmp_path / "src", n=30, garbage=2))
    c = cache(src, tmp_path)
    served = served_digests(epoch(c, 0, batch=7))
    assert len(served) == 30 and len(c.stats.skipped) == 2 and "broken-" in c.stats.skipped[0]
    assert sorted(served_digests(epoch(c, 1, batch=7))) == sorted(served)  # skipped ones stay skipped


def test_fail_policy_stops_before_training_not_mid_epoch(tmp_path):
    src = LabelsCsvSource(make_png_dataset(tmp_path / "src", n=30, garbage=1))
    with pytest.raises(UnreadableSample, match="broken-0.png"):
        cache(src, tmp_path, on_error="fail")


def test_unwritable_cache_dir_falls_back_to_the_source(source, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    events = []
    c = SampleCache(source, PIPE, str(tmp_path / "file" / "cache"), log=events.append)
    assert c.state == "disabled" and "cache disabled" in events[0]
    assert sorted(served_digests(epoch(c, 0))) == fresh_digests(source, PIPE) and c.state == "disabled"


def test_a_shard_locked_by_another_job_is_not_written(source, tmp_path):
    c = cache(source, tmp_path)
    with shard_lock(c.path, blocking=True):
        assert sorted(served_digests(epoch(c, 0))) == fresh_digests(source, PIPE)
    assert c.state == "cold" and any("another job" in e for e in c.stats.events)
    epoch(c, 1)
    assert c.state == "warm"


def test_abandoned_first_epoch_leaves_no_shard_and_no_temp_files(source, tmp_path):
    c = cache(source, tmp_path)
    it = c.batches(0, 10)
    next(it)
    it.close()
    left = [p for p in os.listdir(tmp_path / "cache") if not p.endswith(".lock")]
    assert c.state == "cold" and left == []


def same_batches(got, want) -> bool:
    return len(got) == len(want) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))


@pytest.mark.parametrize("warm", [False, True])
def test_dataloader_workers_give_the_same_batches(source, tmp_path, warm):
    """The batched loader through workers, torch's default collate, and single items: cache.batches' samples."""
    c = cache(source, tmp_path)
    if warm:
        c.warm()
    ds = CachedDataset(c)
    fast = list(ds.loader(16, epoch=3, workers=2))
    plain = list(torch.utils.data.DataLoader(ds, batch_sampler=EpochBatchSampler(c, 16, epoch=3)))
    first = next(iter(EpochBatchSampler(ds, 16, epoch=3)))
    want = epoch(c, 3, batch=16)
    assert same_batches(fast, want) and same_batches(plain, want)
    # A worker hands each batch over as one shared-memory segment, labels included.
    assert all(x.is_shared() and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for x, y in fast)
    x, y = ds[first[1]]
    assert torch.equal(x, want[0][0][1]) and y == want[0][1][1]


@pytest.mark.parametrize("damage", ["label", "sample"])
def test_dataloader_workers_serve_a_corrupt_shard_from_the_source(source, tmp_path, damage):
    """A damaged label (found at open) or sample (found inside a batch): the source's samples, in the same order."""
    c = cache(source, tmp_path, memory_bytes=0)
    c.warm()
    c.close()
    if damage == "label":
        flip_label_byte(c.path, 5)
    else:
        with h5py.File(c.path, "r+") as f:
            f["samples"][5] = f["samples"][5] + 1.0
    c = cache(source, tmp_path, memory_bytes=0)
    served = served_digests(CachedDataset(c).loader(16, workers=1))
    assert served == served_digests(epoch(c, 0, batch=16)) and sorted(served) == fresh_digests(source, PIPE)


def test_samples_missing_from_the_shard_are_decoded_again_in_batch_order(tmp_path):
    """Unreadable when the shard was built: still unreadable, a batch drops them as cache.batches does; repaired
    behind the source's fingerprint (same size and mtime), the batch serves them in their places."""
    root = make_png_dataset(tmp_path / "src", n=30, garbage=2)
    broken = [f"{root}/broken-{g}.png" for g in range(2)]
    good = [open(f"{root}/img-{g:04d}.png", "rb").read() for g in range(2)]
    for path, png in zip(broken, good):
        open(path, "wb").write(b"\0" * len(png))
    c = cache(LabelsCsvSource(root), tmp_path)
    c.warm()
    ds = CachedDataset(c)
    assert (ds.shard_pos < 0).sum() == 2
    assert same_batches(list(ds.loader(7, epoch=1)), epoch(c, 1, batch=7))
    for path, png in zip(broken, good):
        st = os.stat(path)
        open(path, "wb").write(png)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    got = list(ds.loader(7, epoch=2, workers=1))
    want = [(torch.stack([ds[p][0] for p in b]), torch.tensor([ds[p][1] for p in b]))
            for b in EpochBatchSampler(c, 7, 2)]
    assert sum(len(y) for _, y in got) == 32 and same_batches(got, want)


def test_bad_arguments(source, tmp_path):
    with pytest.raises(ValueError, match="on_error"):
        cache(source, tmp_path, on_error="ignore")
    with pytest.raises(ValueError, match="batch size"):
        cache(source, tmp_path).steps(0)
    assert np.array_equal(cache(source, tmp_path, 1, 2).ids, cache(source, tmp_path, 1, 2).ids)


_FULL_DISK = """
import json, sys
sys.path[:0] = [sys.argv[4], sys.argv[5]]
from datacache import Pipeline, SampleCache
from datacache.sources import LabelsCsvSource
from datacache_helpers import fresh_digests, served_digests
pipe = Pipeline(mode="L", mean=(0.5,), std=(0.25,))
src = LabelsCsvSource(sys.argv[1])
out = {}
for name, where in (("full", sys.argv[2]), ("ro", sys.argv[3])):
    events = []
    c = SampleCache(src, pipe, where, log=events.append)
    ok = [sorted(served_digests(list(c.batches(e, 10)))) == fresh_digests(src, pipe) for e in range(2)]
    out[name] = dict(ok=ok, state=c.state, events=events)
print(json.dumps(out))
"""


def test_full_or_read_only_file_system_serves_from_the_source(tmp_path):
    """A 256 KiB tmpfs fills up mid-epoch, a read-only one refuses at once: both epochs still serve every sample."""
    import shutil
    import subprocess
    import sys

    from conftest import ROOT

    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to mount a private tmpfs")
    src = make_png_dataset(tmp_path / "src", n=300, size=28)  # its first 128-sample chunk overflows
    full, ro = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    ro.mkdir()
    (tmp_path / "prog.py").write_text(_FULL_DISK)
    shell = (f"mount -t tmpfs -o size=256k tmpfs {full} && mount -t tmpfs -o ro,size=64k tmpfs {ro} && "
             f"exec {sys.executable} {tmp_path / 'prog.py'} {src} {full} {ro} {ROOT} {ROOT}/tests")
    p = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=120)
    if p.returncode != 0 and "mount" in p.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["full"]["ok"] == [True, True] and out["full"]["state"] == "disabled", out["full"]
    assert any("cannot write the cache" in e and "No space" in e for e in out["full"]["events"]), out["full"]
    assert out["ro"]["ok"] == [True, True] and out["ro"]["state"] == "disabled"
    assert any("cache disabled" in e and "read-only" in e for e in out["ro"]["events"]), out["ro"]


def test_an_unreadable_first_sample_does_not_stop_the_first_epoch(tmp_path):
    root = make_png_dataset(tmp_path / "src", n=20, garbage=1)
    rows = open(f"{root}/labels.csv").read().splitlines()
    open(f"{root}/labels.csv", "w").write("\n".join([rows[0], rows[-1], *rows[1:-1]]) + "\n")  # broken one first
    src = LabelsCsvSource(root)
    assert src.name(0).endswith("broken-0.png")
    c = cache(src, tmp_path)
    assert len(served_digests(epoch(c, 0, batch=5))) == 20 and c.state == "warm" and len(c.stats.skipped) == 1


@pytest.mark.timeout(30)
def test_leaving_an_epoch_early_never_hangs(source, tmp_path):
    """The read-ahead thread may be blocked on a full queue with the epoch's end marker: close() still returns."""
    c = cache(source, tmp_path)
    c.warm()
    for taken in range(c.steps(10) + 1):
        with c.batches(0, 10, prefetch=4) as it:
            for _ in zip(range(taken), it):
                pass


def test_a_corrupt_sample_found_while_loading_memory_is_rebuilt_at_open(source, tmp_path):
    c = cache(source, tmp_path)
    c.warm()
    c.close()
    with h5py.File(c.path, "r+") as f:
        f["samples"][7] = f["samples"][7] - 1.0
    d = cache(source, tmp_path)  # the memory level reads (and verifies) every sample at open
    assert d.state == "cold" and any("invalid" in e for e in d.stats.events)
    assert sorted(served_digests(epoch(d, 0))) == fresh_digests(source, PIPE) and d.state == "warm"


@pytest.mark.parametrize("memory_bytes", [256 << 20, 20 * 64 * 4])  # all of the shard in memory; its first 20
def test_a_shard_damaged_during_the_run_under_memory_is_rewritten_by_that_run(source, tmp_path, memory_bytes):
    """Memory serves position 5 correctly and never reads it on disk again: the epoch's end finds the change and
    rewrites the shard from memory (and verified reads of the rest), not from the source."""
    c = cache(source, tmp_path, memory_bytes=memory_bytes)
    want = fresh_digests(source, PIPE)
    assert sorted(served_digests(epoch(c, 0))) == want and c.state == "warm"  # cold: built from the source
    flip_sample_byte(c.path, 5)
    assert ShardReaderFor(c).verify() == [5]  # what `mpitrain cache verify` would report now
    decoded = c.stats.from_source
    assert sorted(served_digests(epoch(c, 1))) == want and c.stats.from_source == decoded
    assert any("damaged on disk during the run" in e for e in c.stats.events), c.stats.events
    assert c.state == "warm" and ShardReaderFor(c).verify() == []
    assert sorted(served_digests(epoch(cache(source, tmp_path), 2))) == want  # a new job opens it without a rebuild


def test_a_shard_damaged_in_the_last_epoch_is_rewritten_when_the_cache_closes(source, tmp_path):
    c = cache(source, tmp_path)
    c.warm()
    epoch(c, 0)
    flip_sample_byte(c.path, 3)
    with c.batches(1, 10) as it:  # left early, as --max-steps does: the epoch's end is never reached
        next(it)
    c.close()
    assert any("damaged on disk" in e for e in c.stats.events) and ShardReaderFor(c).verify() == []


def ShardReaderFor(c):
    from datacache.shard import ShardReader

    return ShardReader(c.path, c.meta)
