"""jobs.bench.hybcomm_choice here (--local, the mlp): rows per (layer, K), table, summary, JSON, PNG; bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, exit_in_process

JOB = [sys.executable, "-m", "jobs.bench.hybcomm_choice"]


def test_local_run_measures_both_paths_and_the_models_pick(tmp_path):
    out = tmp_path / "choice.json"
    proc = subprocess.run([*JOB, "--local", "--model", "mlp", "--ranks", "2", "--batch-sizes", "2,8", "--layers", "0",
                           "--rounds", "2", "--iters", "1", "--warmup", "0", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["layer"], r["M"], r["N"], r["K"], r["P"]) for r in rows] == [("net.1", 784, 256, 2, 2),
                                                                          ("net.1", 784, 256, 8, 2)]
    from runtime.hybrid.cost_model import Links, layer_cost

    for r in rows:
        assert r["bandwidth"] == "local-unshaped" and r["link_bps"] == 1e9 and r["ranks_per_node"] == 1
        for path in ("sfb", "ps"):
            assert len(r[f"{path}_rounds_s"]) == 2 and min(r[f"{path}_rounds_s"]) > 0
            assert r[f"{path}_min_s"] <= r[f"{path}_s"] <= r[f"{path}_max_s"]
        assert r["measured_faster"] == ("sfb" if r["sfb_s"] < r["ps_s"] else "ps")
        assert r["predicted"] in ("sfb", "ps") and r["agree"] == (r["predicted"] == r["measured_faster"])
        assert r["gflops"] > 0 and r["rebuild_s"] > 0 and r["rebuild_gflops"] > 0
        # The pick and prices are the cost model's for this layer, K, P (two nodes of one) and the priced rate.
        cost = layer_cost("net.1", 784, 256, r["K"], 2, 1, Links(1e9, 40e9, r["gflops"]))
        assert cost.choice == r["predicted"]
        assert (r["predicted_ps_s"], r["predicted_sfb_s"]) == pytest.approx((cost.ps_seconds, cost.sfb_seconds))
    agree = sum(r["agree"] for r in rows)
    assert f"the cost model picked the faster path in {agree} of 2 cases" in proc.stdout
    assert proc.stdout.count("\n- net.1 784×256 K=") == 2 - agree  # every miss listed
    assert "| net.1 784×256 | 2 | 2 |" in proc.stdout and "| net.1 784×256 | 8 | 2 |" in proc.stdout
    for K in (2, 8):  # a progress line per case as it finishes, before the tables
        assert f" s: net.1 784×256 K={K} P=2: sfb " in proc.stdout.split("|")[0]
    summary = doc["meta"]["summary"]
    assert (summary["cases"], summary["agree"], len(summary["misses"])) == (2, agree, 2 - agree)
    # The machine, in the meta and under the compute in the tables' title.
    assert doc["meta"]["machine"]["cores"] >= 1 and "incomplete" not in doc["meta"]
    assert f"\nreal compute\nmachine: {doc['meta']['machine']['cpu_model']}, " in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_local_run_under_emulated_compute_prices_the_rebuild_at_the_devices_rate(tmp_path):
    out = tmp_path / "choice.json"
    proc = subprocess.run([*JOB, "--local", "--model", "mlp", "--ranks", "2", "--batch-sizes", "4", "--layers", "0",
                           "--rounds", "1", "--iters", "1", "--warmup", "0", "--compute", "emulated:v100",
                           "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    (r,) = doc["rows"]
    assert (r["layer"], r["K"], r["P"]) == ("net.1", 4, 2) and r["predicted"] in ("sfb", "ps")
    assert r["compute_device"] == "v100" and {"layers", "optimizer"} <= set(r["emulated_parts"])
    # Not this host's GEMM rate: the device's, modelled on the strategy's probe shape (64 rows of 1024 x 1024).
    from runtime.emulate import compute_model

    v100 = compute_model("v100")
    assert r["gflops"] == pytest.approx(2 * 64 * 1024 ** 2 / v100.gemm_s(1024, 1024, 64) / 1e9)
    assert r["gflops_source"].startswith("modelled") and r["rebuild_modelled_s"] == pytest.approx(
        v100.gemm_s(256, 784, 2 * 4))
    assert doc["meta"]["compute_device"] == "v100" and "\nemulated compute: " in proc.stdout


@pytest.mark.parametrize("args, option", [
    (("--ranks", "0"), "--ranks"),
    (("--ranks", "1,2"), "--ranks"),
    (("--ranks", ","), "--ranks"),
    (("--batch-sizes", ""), "--batch-sizes"),
    (("--batch-sizes", "2,0"), "--batch-sizes"),
    (("--model", "alexnet"), "--model"),
    (("--model", "mlp", "--layers", "2"), "--layers"),
    (("--model", "resnet50", "--layers", "0,1"), "--layers"),
    (("--layers", "first"), "--layers"),
    (("--ranks", "2,3", "--ranks-per-host", "2"), "--ranks-per-host"),
    (("--bandwidth", "none"), "--bandwidth"),
    (("--bandwidth", "fast"), "--bandwidth"),
    (("--rounds", "0"), "--rounds"),
    (("--warmup", "-1"), "--warmup"),
    (("--ranks", "128"), "--ranks"),  # 128 hosts: more than an emulated cluster has
    (("--compute", "emulated:v99"), "--compute"),
    (("--compute", "gpu"), "--compute"),
    (("--compute-scale", "2"), "--compute-scale"),  # real compute takes no scale
])
def test_bad_input_is_one_line_and_exit_2(args, option, capsys):
    # In this process: a subprocess would spend its time importing torch for the layer and bandwidth checks.
    from jobs.bench.hybcomm_choice import parse_args

    code, out, err = exit_in_process(parse_args, ["--model", "mlp", *args], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"error: {option}:") and len(err.strip().splitlines()) == 1


def test_bad_input_exits_2_from_the_command_line():
    proc = subprocess.run([*JOB, "--local", "--ranks", "0"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == "error: --ranks: each must be >= 2, got 0\n" and proc.stdout == ""


@pytest.mark.timeout(120)
def test_a_run_that_failed_exits_1_not_the_bad_input_2(tmp_path):
    """Nothing measured because the run failed (here, timed out): exit 1 and one error line; 2 is bad input."""
    out = tmp_path / "choice.json"
    proc = subprocess.run([*JOB, "--local", "--model", "mlp", "--ranks", "2", "--batch-sizes", "2", "--layers", "0",
                           "--rounds", "1", "--iters", "1", "--warmup", "0", "--timeout", "1", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: job timed out" in proc.stderr and not out.exists()
