"""jobs.bench.scaling runs each strategy on each rank count: the scaling table, JSON and plot (tiny, local)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.timeout(300)  # four MPI jobs: 1 and 2 ranks, two passes
def test_local_scaling_rows_efficiency_json_and_plot(tmp_path):
    out = tmp_path / "scaling.json"
    cmd = [sys.executable, "-m", "jobs.bench.scaling", "--local", "--models", "mlp", "--strategies", "allreduce,wfbp",
           "--ranks", "1,2", "--batch-size", "8", "--batches", "2", "--iters", "1", "--warmup", "1",
           "--rounds", "1", "--passes", "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Two passes over the rank counts, the second reversed (ABBA).
    assert [int(line.split(", ")[1].split()[0]) for line in proc.stdout.splitlines()
            if line.startswith("# mlp at ")] == [1, 2, 2, 1]
    doc = json.loads(out.read_text())
    assert doc["meta"]["command"].startswith("python -m jobs.bench.scaling --local")
    assert doc["meta"]["passes"] == 2 and doc["meta"]["machine"]["cores"] >= 1 and "incomplete" not in doc["meta"]
    rows = {(r["strategy"], r["ranks"]): r for r in doc["rows"]}
    assert sorted(rows) == [("allreduce", 1), ("allreduce", 2), ("wfbp", 1), ("wfbp", 2)]
    for (strategy, ranks), r in rows.items():
        one = rows[(strategy, 1)]
        assert r["baseline_ranks"] == 1 and r["samples_per_s"] > 0 and r["rounds"] == 1  # --rounds reaches the worker
        assert r["passes"] == 2 and len(r["pass_samples_per_s"]) == 2
        # The speed-up: each pass's ratio to the fewest ranks in that pass, then their median and interval.
        ratios = [a / b for a, b in zip(r["pass_samples_per_s"], one["pass_samples_per_s"])]
        assert r["pass_speedups"] == pytest.approx(ratios)
        assert r["speedup"] == pytest.approx(sum(ratios) / 2)
        assert r["speedup_ci"] == pytest.approx(sorted(ratios)) and r["speedup_coverage"] == 0.5
        assert r["efficiency"] == pytest.approx(r["speedup"] / ranks)
        assert f"| mlp | local-unshaped | {strategy} | {ranks} | {r['samples_per_s']:.1f} |" in proc.stdout
    assert "| speed-up (CI) | efficiency (CI) |" in proc.stdout
    # The title: the compute, the machine and the intervals' coverage for 2 passes (not "95 %").
    assert "\nreal compute\nmachine: " in proc.stdout and "a 50 % CI (95 % needs >= 6 passes)" in proc.stdout
    assert "±95" not in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_speedups_are_the_median_of_each_passs_ratio_not_a_ratio_of_medians():
    """A slow spell in one pass slows every count it runs: within a pass the ratio is unmoved."""
    from jobs.bench.scaling import combine

    def row(ranks, p, rate):
        return dict(model="m", bandwidth="b", strategy="s", ranks=ranks, rounds=1, ci=0.0,
                    samples_per_s_ci=[rate, rate], samples_per_s=rate, **{"pass": p})
    rates = {1: [100.0, 50.0, 100.0], 2: [180.0, 90.0, 180.0]}  # pass 1 ran at half speed throughout
    out = {r["ranks"]: r for r in combine([row(n, p, v) for n, vs in rates.items() for p, v in enumerate(vs)])}
    assert out[2]["pass_speedups"] == pytest.approx([1.8, 1.8, 1.8])
    assert out[2]["speedup"] == pytest.approx(1.8) and out[2]["efficiency"] == pytest.approx(0.9)
    assert out[2]["speedup_ci"] == pytest.approx([1.8, 1.8]) and out[2]["speedup_coverage"] == 0.75
    assert out[2]["samples_per_s"] == 180.0 and out[2]["samples_per_s_ci"] == [90.0, 180.0]


@pytest.mark.timeout(120)
def test_a_sweep_whose_run_failed_exits_1_not_the_bad_input_2(tmp_path):
    """Nothing measured because the run failed (here, timed out): a failed run, not bad input."""
    out = tmp_path / "scaling.json"
    proc = subprocess.run([sys.executable, "-m", "jobs.bench.scaling", "--local", "--models", "mlp", "--strategies",
                           "allreduce", "--ranks", "1,2", "--rounds", "1", "--timeout", "1",
                           "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: job timed out" in proc.stderr and not out.exists()


def _worker_takes_compute() -> bool:
    from jobs.bench import strategies_worker

    return hasattr(strategies_worker, "add_compute_arguments")


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _worker_takes_compute(), reason="the strategies worker does not take --compute yet")
def test_local_scaling_under_emulated_compute(tmp_path):
    out = tmp_path / "scaling.json"
    cmd = [sys.executable, "-m", "jobs.bench.scaling", "--local", "--models", "mlp", "--strategies", "allreduce",
           "--ranks", "1,2", "--batch-size", "8", "--batches", "2", "--iters", "1", "--warmup", "1",
           "--rounds", "1", "--passes", "1", "--compute", "emulated:v100", "--json", str(out)]  # one pass: the
    # passes' order and ratios are the test above's; this one is about the compute
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
