"""jobs.common.cluster_sweep: the rows so far kept beside --json while a sweep runs, gone when it ends."""

from __future__ import annotations

import sys
from argparse import Namespace

from jobs.common.cluster_sweep import partial_path, sweep

# A worker (under mpiexec, one rank) that reports what the sweep has kept so far, as a ROW.
WORKER = """
import json, os, sys
path = sys.argv[1]
kept = json.load(open(path))["rows"] if os.path.exists(path) else []
print("ROW " + json.dumps({"model": sys.argv[2], "kept": [r["model"] for r in kept]}))
"""


def test_a_sweep_keeps_its_rows_so_far_beside_the_json_and_removes_them_at_the_end(tmp_path, capsys):
    args = Namespace(local=True, bandwidths=None, models=["a", "b", "c"], hosts=1, timeout=60,
                     json=str(tmp_path / "out.json"))
    path = partial_path(args)
    assert path == str(tmp_path / "out.partial.json")
    rows = sweep(args, lambda model, label, n: [sys.executable, "-c", WORKER, path, model],
                 lambda new: "| h |\n|---|\n" + "\n".join(f"| {r['model']} |" for r in new))
    # Each run saw every earlier run's rows in the file, written as they came.
    assert [(r["model"], r["kept"]) for r in rows] == [("a", []), ("b", ["a"]), ("c", ["a", "b"])]
    assert not (tmp_path / "out.partial.json").exists()
    assert "| c |" in capsys.readouterr().out


def test_a_failed_run_returns_the_rows_so_far_and_leaves_no_partial_file(tmp_path):
    args = Namespace(local=True, bandwidths=None, models=["a", "fail"], hosts=1, timeout=60,
                     json=str(tmp_path / "out.json"))
    worker = "import sys; print('ROW ' + '{\"model\": \"a\"}') if sys.argv[1] == 'a' else sys.exit(3)"
    rows = sweep(args, lambda model, label, n: [sys.executable, "-c", worker, model], lambda new: "|\n|\n|")
    assert rows == [{"model": "a"}]
    assert not (tmp_path / "out.partial.json").exists()
