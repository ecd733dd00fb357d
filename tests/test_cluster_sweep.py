"""jobs.common.cluster_sweep: the rows so far kept beside --json while a sweep runs, gone when it ends."""

from __future__ import annotations

import sys
from argparse import Namespace

from jobs.common.cluster_sweep import exit_status, incomplete_meta, incomplete_note, partial_path, sweep

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
    rows, failed = sweep(args, lambda model, label, n: [sys.executable, "-c", WORKER, path, model],
                         lambda new: "| h |\n|---|\n" + "\n".join(f"| {r['model']} |" for r in new))
    assert failed == []
    # Each run saw every earlier run's rows in the file, written as they came.
    assert [(r["model"], r["kept"]) for r in rows] == [("a", []), ("b", ["a"]), ("c", ["a", "b"])]
    assert not (tmp_path / "out.partial.json").exists()
    assert "| c |" in capsys.readouterr().out


def test_a_failed_run_returns_the_rows_so_far_names_what_failed_and_leaves_no_partial_file(tmp_path, capsys):
    args = Namespace(local=True, bandwidths=None, models=["a", "fail", "c"], hosts=1, timeout=60,
                     json=str(tmp_path / "out.json"))
    worker = "import sys; print('ROW ' + '{\"model\": \"a\"}') if sys.argv[1] == 'a' else sys.exit(3)"
    rows, failed = sweep(args, lambda model, label, n: [sys.executable, "-c", worker, model], lambda new: "|\n|\n|")
    assert rows == [{"model": "a"}]
    # The run that failed, with why, and the one the failure left unrun: what an incomplete JSON names.
    assert [(f["run"], f["bandwidth"], f["ranks"]) for f in failed] == [("fail", "local-unshaped", 1),
                                                                        ("c", "local-unshaped", 1)]
    assert "exit 3" in failed[0]["error"] and failed[1]["error"] == "not run"
    assert incomplete_meta(failed) == {"incomplete": True, "failed_runs": failed} and incomplete_meta([]) == {}
    assert incomplete_note(failed) == "INCOMPLETE: fail at local-unshaped, 1 rank failed; 1 more run not run"
    assert exit_status(failed) == 1 and exit_status([]) == 0
    assert capsys.readouterr().err.startswith("error: worker failed (exit 3)")
    assert not (tmp_path / "out.partial.json").exists()
