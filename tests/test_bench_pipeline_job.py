"""jobs.bench.pipeline runs every contender side by side; writes its table, summary, JSON and plot (tiny, unshaped)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

CONTENDERS = ["flush", "vanilla", "stash", "spectrain", "allreduce", "wfbp", "p3", "ddp", "torch-1f1b"]


def run_tiny(out, batch: int, *extra) -> tuple[dict, str]:
    """The benchmark on a tiny MLP, 4 local ranks, one round: its JSON and what it printed."""
    cmd = [sys.executable, "-m", "jobs.bench.pipeline", "--local", "--hosts", "4", "--models", "mlp",
           "--hidden", "64,64,64", "--batch-size", str(batch), "--microbatches", "4", "--rounds", "1", "--iters", "2",
           "--warmup", "1", *extra, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_local_bench_pipeline_rows_summary_and_plot(tmp_path):
    out = tmp_path / "bp.json"
    doc, stdout = run_tiny(out, 32)
    rows = doc["rows"]
    assert [r["contender"] for r in rows] == CONTENDERS
    for r in rows:
        assert r["model"] == "mlp" and r["ranks"] == 4 and r["batch"] == 32 and r["bandwidth"] == "local-unshaped"
        assert r["samples_per_s"] > 0 and r["t_iter_s"] > 0 and r["bytes_per_step"] > 0, r
        assert r["rounds"] == 1 and r["steps"] == 2 and r["rss_mb"] > 0
        # The rate is the batch over the step's time, never a mean of per-step rates (wrong for uneven steps).
        assert r["samples_per_s"] == pytest.approx(32 / r["t_iter_s"], rel=1e-9), r
        assert r["samples_per_s_ci"][0] <= r["samples_per_s"] <= r["samples_per_s_ci"][1]
    by = {r["contender"]: r for r in rows}
    assert {by[c]["kind"] for c in CONTENDERS[:4]} == {"pipeline"} and by["torch-1f1b"]["kind"] == "peer"
    # Pipelines: the engine's own count, the same activations and gradients whatever the weight mode.
    assert {by[c]["bytes_measured"] for c in CONTENDERS[:4]} == {"engine count"}
    assert len({by[c]["bytes_per_step"] for c in CONTENDERS[:4]}) == 1
    # Data parallel: the ring allreduce's 2 (P - 1) / P x gradient bytes; the mlp 784-64-64-64-10 in float32.
    params = 784 * 64 + 64 + 2 * (64 * 64 + 64) + 64 * 10 + 10
    for c in ("allreduce", "wfbp", "p3", "ddp"):
        assert by[c]["bytes_measured"] == "computed" and by[c]["bytes_per_step"] == 2 * 3 / 4 * 4 * params
    # The same balance for every pipeline and torch's; micro-batches everywhere but data parallelism.
    assert len({tuple(by[c]["balance"]) for c in [*CONTENDERS[:4], "torch-1f1b"]}) == 1
    assert sum(by["flush"]["balance"]) == 8 and by["allreduce"]["microbatches"] is None
    # Stash keeps weight versions, flush none; one update per micro-batch in the asynchronous modes.
    # Stash copies only weights that a backward reads: a Linear whose input needs a gradient (one
    # after the first Linear), on a stage that is not the last (which never holds versions). The
    # balance is measured, so whether any stage qualifies depends on it ([1,1,1,5]: none does).
    layers = ["Flatten", "Linear", "ReLU", "Linear", "ReLU", "Linear", "ReLU", "Linear"]  # mlp 64,64,64
    bounds = [sum(by["stash"]["balance"][:k]) for k in range(len(by["stash"]["balance"]) + 1)]
    copies = any(layers[j] == "Linear" and j > 1 for k in range(len(bounds) - 2) for j in range(*bounds[k:k + 2]))
    assert by["flush"]["weight_copy_bytes"] == 0 and (by["stash"]["weight_copy_bytes"] > 0) == copies
    assert by["flush"]["updates_per_step"] == 1 and by["spectrain"]["updates_per_step"] == 4
    summary = doc["meta"]["summary"]
    assert len(summary) == 1 and summary[0]["async_over_dp"] > 0 and summary[0]["dp_over_pipeline_bytes"] > 1
    assert "| mlp | torch-1f1b | local-unshaped |" in stdout and "flush / torch-1f1b" in stdout
    # One round: no interval, so neither rate target is decided.
    assert summary[0]["met"]["async_over_dp"] == "undecided" and summary[0]["met"]["flush_over_torch"] == "undecided"
    assert doc["meta"]["machine"]["cores"] >= 1 and "incomplete" not in doc["meta"]
    assert f"\nreal compute\nmachine: {doc['meta']['machine']['cpu_model']}, " in stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def _rows(times: dict) -> list[dict]:
    """Summarize's input: each contender's T_iter round by round (the same batch: rate ratios invert them)."""
    return [dict(model="fc-heavy", bandwidth="1gbit", contender=c, t_iter_rounds_s=t, samples_per_s=1 / sorted(t)[1],
                 bytes_per_step=None, weight_copy_bytes=None) for c, t in times.items()]


def test_the_targets_are_judged_on_the_rounds_paired_ratios_and_undecided_when_the_interval_straddles():
    from jobs.bench.pipeline import summarize

    # flush over torch-1f1b round by round: 1.2, 0.9, 1.1 (the interval 0.9-1.2 straddles 1.0): undecided, though
    # the ratio of the medians (1.1) would say met. The async pipeline 2x-2.2x the data-parallel rate: met.
    s, = summarize(_rows({"flush": [1.0, 1.0, 1.0], "torch-1f1b": [1.2, 0.9, 1.1], "stash": [1.0, 2.0, 1.0],
                          "allreduce": [2.0, 4.4, 2.1]}))
    assert s["flush_over_torch_paired"]["ci"] == pytest.approx([0.9, 1.2])
    assert s["met"]["flush_over_torch"] == "undecided"
    assert s["flush_over_torch"] == pytest.approx(1.1) and s["flush_over_torch_paired"]["coverage"] == 0.75
    assert s["async_over_dp_paired"]["ci"] == pytest.approx([2.0, 2.2]) and s["met"]["async_over_dp"] == "met"
    # A slow spell in round 2 slowed both: paired, the ratio is unmoved and clearly below the target.
    s, = summarize(_rows({"flush": [1.0, 3.0, 1.0], "torch-1f1b": [0.5, 1.5, 0.5]}))
    assert s["flush_over_torch_paired"]["ci"] == pytest.approx([0.5, 0.5]) and s["met"]["flush_over_torch"] == "not met"


def test_worker_rejects_unknown_contender():
    proc = subprocess.run([sys.executable, "-m", "jobs.bench.pipeline_worker", "--contenders", "gpipe"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "--contenders: unknown 'gpipe'" in proc.stderr


def test_local_bench_pipeline_under_emulated_compute(tmp_path):
    """Every pipeline mode, data parallelism and torch's 1F1B under one compute model; rows, meta and title say so."""
    out = tmp_path / "emulated.json"
    contenders = ["flush", "vanilla", "stash", "spectrain", "allreduce", "torch-1f1b"]
    doc, stdout = run_tiny(out, 16, "--contenders", ",".join(contenders), "--compute", "emulated:v100")
    rows = doc["rows"]
    assert [r["contender"] for r in rows] == contenders
    for r in rows:
        assert r["compute_device"] == "v100" and r["compute_scale"] == 1.0 and "v100" in r["compute"]
        assert {"layers", "optimizer"} <= set(r["emulated_parts"]) and r["samples_per_s"] > 0, r
        assert r["t_iter_rounds_s"] == [r["t_iter_s"]]  # one round: its T_iter is the median
    by = {r["contender"]: r for r in rows}
    # The same activations cross the stages as with real compute: the true bytes, whatever the weight mode.
    assert len({by[c]["bytes_per_step"] for c in contenders[:4] + ["torch-1f1b"]}) == 1
    assert by["flush"]["bytes_per_step"] > 0 and len({tuple(by[c]["balance"]) for c in ("flush", "torch-1f1b")}) == 1
    assert "weight versions" in by["stash"]["emulated_parts"] and "weight versions" not in by["flush"]["emulated_parts"]
    assert doc["meta"]["compute_device"] == "v100" and "emulated compute" in doc["meta"]["compute_label"]
    assert "\nemulated compute: " in stdout and "| mlp | torch-1f1b | local-unshaped |" in stdout


def test_bad_compute_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "jobs.bench.pipeline", "--local", "--models", "mlp", "--compute",
                           "emulated:v99"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: --compute: unknown device 'v99'") and len(proc.stderr.splitlines()) == 1


def test_worker_timeline_has_every_stages_passes_updates_and_waits(tmp_path):
    """--timeline: one Chrome trace of the pipeline contenders, each rank's forwards, backwards, updates and
    waits for its neighbours (what a pipeline's step is made of, to set beside the simulator's schedule)."""
    from mpicomm.launch import mpiexec

    out = tmp_path / "tl.json"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "jobs.bench.pipeline_worker", "--model", "mlp", "--hidden",
           "64,64,64", "--contenders", "vanilla", "--batch-size", "16", "--microbatches", "4", "--rounds", "1",
           "--iters", "2", "--warmup", "1", "--compute", "emulated:v100", "--timeline", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spans = [e for e in json.loads(out.read_text())["traceEvents"] if e.get("ph") == "X"]
    for rank in (0, 1):
        kinds = {e["name"][0] for e in spans if e["pid"] == rank and e["name"][0] in "FBU"}
        assert kinds == {"F", "B", "U"}, (rank, kinds)
    # warm-up, one step after the barrier (the pipeline flowing again before the window opens), 2 timed: 4 steps
    # of 4 micro-batches, each updated once on each of the 2 stages (vanilla), the drain's too
    assert sum(e["cat"] == "update" for e in spans) == 2 * 4 * 4
    waits = [e for e in spans if e["name"].startswith("wait") and e["pid"] == 1]
    # each names the message it waits for, so a reader can match it to its send
    assert waits and all(e["args"]["waits_for"].startswith(("activation of micro-batch ", "gradient of micro-batch "))
                         for e in waits)
    assert not list(tmp_path.glob("tl.json.rank*"))  # the parts merged and removed
    # The row says, per stage, how long each send held its host (21 quantiles, seconds): stage 0 sends activations
    # only, stage 1 gradients only.
    (row,) = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    first, second = row["send_host_s"]
    assert first["grad"] is None and second["act"] is None
    for q in (first["act"], second["grad"]):
        assert len(q) == 21 and 0 <= q[0] and q == sorted(q) and q[-1] < 5, q
    # ... and each forward's, backward's and update's host work, every stage (vanilla: an update a micro-batch)
    assert len(row["op_host_s"]) == 2
    for stage in row["op_host_s"]:
        for q in stage.values():
            assert len(q) == 21 and 0 <= q[0] and q == sorted(q) and q[-1] < 5, q


def test_send_quantiles_run_from_the_least_to_the_most():
    from jobs.bench.pipeline_sends import quantiles

    assert quantiles([]) is None and quantiles([0.5]) == [0.5] * 21
    q = quantiles([3.0, 1.0, 2.0], points=5)
    assert q == [1.0, 1.5, 2.0, 2.5, 3.0]


@pytest.mark.timeout(120)
def test_a_run_that_failed_exits_1_not_the_bad_input_2(tmp_path):
    """Nothing measured because the run failed (here, timed out): exit 1 and one error line; 2 is bad input."""
    out = tmp_path / "bp.json"
    proc = subprocess.run([sys.executable, "-m", "jobs.bench.pipeline", "--local", "--hosts", "2", "--models", "mlp",
                           "--contenders", "flush", "--rounds", "1", "--iters", "1", "--warmup", "0", "--timeout", "1",
                           "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: job timed out" in proc.stderr and not out.exists()
