"""jobs.bench.scaling runs each strategy on each rank count: the scaling table, JSON and plot (tiny, local)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.timeout(300)  # two MPI jobs, 1 and 2 ranks
def test_local_scaling_rows_efficiency_json_and_plot(tmp_path):
    out = tmp_path / "scaling.json"
    cmd = [sys.executable, "-m", "jobs.bench.scaling", "--local", "--models", "mlp", "--strategies", "allreduce,wfbp",
           "--ranks", "1,2", "--batch-size", "8", "--batches", "2", "--iters", "1", "--warmup", "1",
           "--rounds", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["meta"]["command"].startswith("python -m jobs.bench.scaling --local")
    rows = {(r["strategy"], r["ranks"]): r for r in doc["rows"]}
    assert sorted(rows) == [("allreduce", 1), ("allreduce", 2), ("wfbp", 1), ("wfbp", 2)]
    for (strategy, ranks), r in rows.items():
        one = rows[(strategy, 1)]
        assert r["baseline_ranks"] == 1 and r["samples_per_s"] > 0 and r["rounds"] == 1  # --rounds reaches the worker
        assert abs(r["speedup"] - r["samples_per_s"] / one["samples_per_s"]) < 1e-9
        assert abs(r["efficiency"] - r["samples_per_s"] / (ranks * one["samples_per_s"])) < 1e-9
        assert f"| mlp | local-unshaped | {strategy} | {ranks} | {r['samples_per_s']:.1f} |" in proc.stdout
    assert "| speed-up | efficiency |" in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def _worker_takes_compute() -> bool:
    from jobs.bench import strategies_worker

    return hasattr(strategies_worker, "add_compute_arguments")


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _worker_takes_compute(), reason="the strategies worker does not take --compute yet")
def test_local_scaling_under_emulated_compute(tmp_path):
    out = tmp_path / "scaling.json"
    cmd = [sys.executable, "-m", "jobs.bench.scaling", "--local", "--models", "mlp", "--strategies", "allreduce",
           "--ranks", "1,2", "--batch-size", "8", "--batches", "2", "--iters", "1", "--warmup", "1",
           "--rounds", "1", "--compute", "emulated:v100", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {(r["strategy"], r["ranks"]): r for r in doc["rows"]}
    assert sorted(rows) == [("allreduce", 1), ("allreduce", 2)]
    for r in rows.values():
        assert r["samples_per_s"] > 0 and r["efficiency"] > 0 and r["compute_device"] == "v100"
        assert "layers" in r["emulated_parts"]
    assert doc["meta"]["compute_device"] == "v100" and "\nemulated compute: " in proc.stdout


@pytest.mark.parametrize("args, option", [
    (("--compute", "emulated:v99"), "--compute"),
    (("--compute", "emulated:"), "--compute"),
    (("--compute-scale", "0", "--compute", "emulated:v100"), "--compute-scale"),
])
def test_bad_compute_is_one_line_and_exit_2(args, option, capsys):
    from jobs.bench.scaling import parse_args

    with pytest.raises(SystemExit) as exit:
        parse_args(["--local", "--models", "mlp", "--strategies", "allreduce", "--ranks", "1,2", *args])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == ""
    assert err.startswith(f"error: {option}:") and len(err.strip().splitlines()) == 1


def test_the_batch_defaults_to_the_papers_under_emulation_and_to_8_when_real():
    """Poseidon's VGG19-22K trained 32 a GPU: scaling under emulated compute runs that batch unless told, as the
    strategies benchmark does; real compute keeps the CPU-sized default of 8, and --batch-size wins over both."""
    from jobs.bench.scaling import parse_args
    from jobs.bench.strategies import run_settings

    base = ["--local", "--models", "vgg19-22k-224", "--strategies", "hybcomm", "--ranks", "1,2"]
    assert run_settings(parse_args([*base, "--compute", "emulated:titanx"]), "vgg19-22k-224")["batch_size"] == 32
    assert run_settings(parse_args(base), "vgg19-22k-224")["batch_size"] == 8
    given = parse_args([*base, "--compute", "emulated:titanx", "--batch-size", "4"])
    assert run_settings(given, "vgg19-22k-224")["batch_size"] == 4
