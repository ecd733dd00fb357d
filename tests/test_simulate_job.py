"""jobs.simulate end to end: a profile taken under MPI, the projection's table/JSON/PNG, its errors, and --validate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from mpicomm.emulation import netns

STRATEGIES = "allreduce,wfbp,ddp,p3,hybcomm,topk,hier-topk,allreduce+pto,pipeline-flush,pipeline-spectrain"


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "jobs.simulate", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.fixture(scope="module")
def mlp_profile(tmp_path_factory):
    """mlp profiled on 2 ranks at once (a real MPI job)."""
    path = tmp_path_factory.mktemp("profiles") / "mlp-r2.json"
    proc = run("--take-profile", "--model", "mlp", "--ranks", "2", "--batch-size", "8", "--out", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


@pytest.mark.timeout(300)
def test_take_profile_writes_every_layer_measured_on_every_rank(mlp_profile):
    import torch

    from runtime.sim import Profile
    from runtime.workloads.models import build_model

    p = Profile.load(str(mlp_profile))
    assert p.model == "mlp" and p.ranks_at_once == 2 and p.batch_size == 8 and len(p.extra["step_s_ranks"]) == 2
    linears = [m for m in build_model("mlp").modules() if isinstance(m, torch.nn.Linear)]
    assert [l.linear[:2] for l in p.layers] == [(m.in_features, m.out_features) for m in linears]
    assert p.compute_s > 0 and all(l.fwd_s > 0 and l.bwd_s > 0 for l in p.layers)


@pytest.mark.timeout(300)
def test_projection_to_128_nodes_table_json_and_plot(mlp_profile, tmp_path):
    out = tmp_path / "proj.json"
    proc = run("--model", "mlp", "--profile", str(mlp_profile), "--nodes", "2,128", "--ranks-per-node", "8",
               "--bandwidth", "10gbit,100gbit", "--strategies", STRATEGIES, "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * len(STRATEGIES.split(","))
    assert doc["meta"]["profile"]["model"] == "mlp"
    for r in rows:
        assert r["t_iter_s"] > 0 and r["samples_per_s"] > 0
        if r["nodes"] == 2:
            assert r["speedup"] == 1.0
    assert "| mlp | p3 | 100 | 128 | 1024 |" in proc.stdout and "simulations in" in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change,message", [
    ("zero", "take no time: not a measured step"),  # was a ZeroDivisionError (speed-up against 0 samples/s)
    ("negative", "negative or missing times (net.1 forward -0.001 s, "),
])
def test_a_profile_without_compute_is_one_line_and_exit_2(mlp_profile, tmp_path, change, message):
    doc = json.loads(mlp_profile.read_text())
    for layer in doc["layers"]:
        layer["fwd_s"] = layer["bwd_s"] = 0.0 if change == "zero" else -0.001
    doc.update(step_s=0.0, optimizer_s=0.0, other_s=0.0, select_s_per_element=0.0)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    proc = run("--profile", str(bad), "--nodes", "1,2", "--ranks-per-node", "1", "--strategies", "allreduce")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: profile of 'mlp': ") and message in proc.stderr, proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,message", [
    (["--strategies", "gossip"], "no simulated schedule for 'gossip'"),
    (["--nodes", "0"], "--nodes"),
    (["--profile", "/nonexistent.json"], "no such file"),
    (["--take-profile"], "--out"),
])
def test_bad_arguments_are_refused_with_a_reason(args, message):
    proc = run("--model", "mlp", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.cluster
@pytest.mark.skipif(netns.why_not() is not None, reason=f"{netns.why_not()}")
@pytest.mark.timeout(900)
def test_validate_measures_profiles_calibrates_and_compares(tmp_path):
    out = tmp_path / "val.json"
    proc = run("--validate", "--ranks", "2", "--bandwidths", "1gbit", "--models", "mlp", "--strategies",
               "allreduce,wfbp", "--batch-size", "8", "--rounds", "1", "--batches", "1", "--warmup", "1",
               "--profiles", str(tmp_path / "profiles"), "--json", str(out), timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {r["strategy"] for r in doc["rows"]} == {"compute", "allreduce", "wfbp"}
    for r in doc["rows"]:
        assert r["measured_s"] > 0 and r["simulated_s"] > 0
        assert r["error"] == pytest.approx((r["simulated_s"] - r["measured_s"]) / r["measured_s"])
    t = doc["meta"]["calibration"]["transport"]
    assert t["rate"] > 0 and t["cpu_per_byte"] > 0 and 0 < t["efficiency"] <= 1
    assert (tmp_path / "profiles" / "mlp-b8-r2.json").exists() and (tmp_path / "val-measured-2r.json").exists()
    assert "worst:" in proc.stdout and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
