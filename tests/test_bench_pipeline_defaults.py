"""jobs.bench.pipeline_defaults' table and plot from rows (no training here): gaps to flush, a stopped run, before."""

from __future__ import annotations

from jobs.bench import pipeline_defaults as bench


def rows(accs: dict) -> list[dict]:
    return [dict(model=model, mode=mode, seed=s, test_accuracy=a, stopped=None if a is not None else "error: rank 0")
            for (model, mode), seeds in accs.items() for s, a in enumerate(seeds)]


AFTER = rows({("mlp", "flush"): [0.84, 0.85], ("mlp", "vanilla"): [0.83, 0.83], ("mlp", "spectrain"): [0.80, 0.81],
              ("mlp", "stash"): [0.84, None]})
BEFORE = rows({("mlp", "flush"): [0.84, 0.85], ("mlp", "vanilla"): [0.25, 0.30]})


def test_table_gives_each_seed_the_mean_and_the_gap_to_flush_marking_misses():
    text = bench.table(AFTER, ["mlp"], ["flush", "vanilla", "stash", "spectrain"], [0, 1], BEFORE)
    lines = {line.split(" | ")[1]: line for line in text.splitlines()[2:]}
    assert "| 84.00 % | 85.00 % | 84.50 % | — |" in lines["flush"]
    assert "83.00 % | -1.50 points |" in lines["vanilla"] and "27.50 % | -57.00 points ✗ |" in lines["vanilla"]
    assert "80.50 % | -4.00 points ✗ |" in lines["spectrain"]
    assert "| stopped | stopped | n/a |" in lines["stash"]  # a seed stopped: no mean
    assert "before: mean" in text


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "p.png"
    bench.plot(AFTER, ["mlp"], ["flush", "vanilla", "stash", "spectrain"], str(path), BEFORE)
    assert path.read_bytes()[:4] == b"\x89PNG"
