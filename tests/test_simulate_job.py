"""jobs.simulate end to end: a profile taken under MPI, the projection's table/JSON/PNG and its errors (--validate: test_simulate_validate_job.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, exit_in_process

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
    assert p.extra["rank_devices"] == ["cpu", "cpu"]
    linears = [m for m in build_model("mlp").modules() if isinstance(m, torch.nn.Linear)]
    assert [l.linear[:2] for l in p.layers] == [(m.in_features, m.out_features) for m in linears]
    assert p.compute_s > 0 and all(l.fwd_s > 0 and l.bwd_s > 0 for l in p.layers)


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(cuda_devices() < 2, reason="needs 2 CUDA devices (torch sees fewer)")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks_per_node, devices", [(None, ["cuda:0", "cuda:1"]), ("1", ["cuda:0", "cuda:0"])])
def test_a_gpu_profile_takes_each_ranks_gpu_by_its_local_rank(tmp_path, ranks_per_node, devices):
    """Two ranks on one host take GPUs 0 and 1; as two (emulated) hosts of one rank each, both take their host's
    first GPU, as the training jobs do. By world rank the second would have timed GPU 1 while synchronising GPU 0."""
    from runtime.sim import Profile

    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("MPITRAIN_RANKS_PER_NODE", None)
    env.update({"MPITRAIN_RANKS_PER_NODE": ranks_per_node} if ranks_per_node else {})
    out = tmp_path / "mlp-cuda.json"
    proc = subprocess.run([sys.executable, "-m", "jobs.simulate", "--take-profile", "--device", "cuda", "--model",
                           "mlp", "--ranks", "2", "--batch-size", "8", "--out", str(out)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Profile.load(str(out)).extra["rank_devices"] == devices


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


@pytest.mark.timeout(300)
def test_projection_from_a_device_model_takes_no_profile_and_says_whose_compute(tmp_path):
    out = tmp_path / "proj.json"
    proc = run("--model", "resnet50-224", "--compute", "emulated:v100", "--nodes", "1,4", "--ranks-per-node", "1",
               "--bandwidth", "1gbit,100gbit", "--strategies", "allreduce,p3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no --profile: profiling" not in proc.stdout and "modelled: v100" in proc.stdout
    doc = json.loads(out.read_text())
    prof = doc["meta"]["profile"]
    assert prof["batch_size"] == 32 and prof["device"] == "cuda" and prof["machine"].startswith("modelled: v100")
    t = {(r["strategy"], r["bandwidth_bps"], r["nodes"]): r["t_iter_s"] for r in doc["rows"]}
    # One node: the modelled step, and the gradients' copies to the host (behind the backward but the last
    # layer's) and back, as the runtime stages them for MPI; 102 MB over 1 Gbit/s links: far slower than over
    # 100 Gbit/s ones.
    copy_s = sum(sum(layer["params"]) for layer in prof["layers"]) * prof["itemsize"] / (prof["copy_gbs"] * 1e9)
    assert prof["step_s"] + copy_s <= t["allreduce", 1e9, 1] <= prof["step_s"] + 2 * copy_s
    assert t["allreduce", 1e9, 4] > 3 * t["allreduce", 100e9, 4]


@pytest.mark.timeout(300)
def test_the_papers_beside_ours_one_table_each_with_the_papers_figures(tmp_path):
    out = tmp_path / "papers.json"
    proc = run("--papers", "--only", "poseidon,spectrain", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["paper"] for r in rows} == {"poseidon", "spectrain"}
    claimed = {(r["paper"], r["model"], r["config"]): r["paper_figure"] for r in rows if r["paper_figure"] is not None}
    assert claimed[("poseidon", "vgg19-22k-224", "16 x 1, 10 GbE")] == 15.5 and len(claimed) == 4
    for r in rows:
        assert r["ours"] > 0 and r["device"] in ("titanx", "1080ti")
    speedups = {r["config"]: r["ours"] for r in rows if r["metric"] == "hybcomm speed-up"}
    assert speedups["8 x 1, 10 GbE"] < speedups["16 x 1, 10 GbE"] < speedups["32 x 1, 10 GbE"] <= 32
    assert "| poseidon | vgg19-22k-224 | titanx | 16 x 1, 10 GbE | hybcomm speed-up |" in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    bad = run("--papers", "--only", "dawnbench")
    assert bad.returncode == 2 and "unknown paper 'dawnbench'" in bad.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,message", [
    (["--strategies", "gossip"], "no simulated schedule for 'gossip'"),
    (["--nodes", "0"], "--nodes"),
    (["--profile", "/nonexistent.json"], "no such file"),
    (["--take-profile"], "--out"),
    (["--compute", "emulated:tpu9"], "--compute"),
    (["--compute", "gpu"], "write real, emulated:DEVICE"),
])
def test_bad_arguments_are_refused_with_a_reason(args, message, capsys):
    from jobs.simulate import main

    code, _, err = exit_in_process(main, ["--model", "mlp", *args], capsys)
    assert code == 2 and message in err, err[-2000:]


EMULATED = ["--model", "mlp", "--compute", "emulated:h100"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,message", [
    # Projection's N times *faster*: --compute-scale (N times slower in train, --validate, the benchmarks) refused.
    (["--compute-scale", "10"], "--compute-scale: projection takes --compute-speedup N"),
    (["--compute-speedup", "0"], "--compute-speedup: must be a finite number > 0"),
    (["--compute-speedup", "inf"], "--compute-speedup: must be a finite number > 0"),
    (["--strategies", "pipeline-flush", "--nodes", "1", "--ranks-per-node", "1"],
     "--strategies: no strategy fits these --nodes/--ranks-per-node (pipeline-flush skipped on 1 node(s)"),
    (["--cores-per-host", "-1"], "--cores-per-host: must be a finite number > 0, got -1.0"),
    (["--latency", "nan"], "--latency: must be a finite number >= 0, got nan"),
    (["--oversubscription", "inf"], "--oversubscription: must be a finite number >= 1, got inf"),
    (["--strategies", "topk", "--density", "-1"], "--density: must be in (0, 1], got -1.0"),
    (["--strategies", "topk", "--density", "5"], "--density: must be in (0, 1], got 5.0"),
], ids=["compute-scale", "speedup-zero", "speedup-inf", "no-strategy-fits", "cores-negative", "latency-nan",
        "oversubscription-inf", "density-negative", "density-above-1"])
def test_projection_refuses_what_it_cannot_project_in_one_line(args, message, capsys):
    from jobs.simulate import main

    code, out, err = exit_in_process(main, [*EMULATED, "--nodes", "1,2", "--ranks-per-node", "2", *args], capsys)
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err[-2000:]
    assert "| mlp |" not in out


@pytest.mark.timeout(120)
def test_compute_speedup_makes_compute_faster_and_every_row_and_the_figure_say_whose(tmp_path, capsys):
    from jobs.simulate import figure, main

    docs = {}
    for speedup in ("1", "10"):
        out = tmp_path / f"x{speedup}.json"
        code, stdout, err = exit_in_process(main, [*EMULATED, "--nodes", "1,2,4", "--ranks-per-node", "1",
                                                   "--bandwidth", "100gbit", "--strategies", "allreduce",
                                                   "--compute-speedup", speedup, "--json", str(out)], capsys)
        assert code == 0, err[-2000:]
        docs[speedup] = json.loads(out.read_text())
    one = {r["nodes"]: r["t_iter_s"] for r in docs["1"]["rows"]}
    ten = {r["nodes"]: r["t_iter_s"] for r in docs["10"]["rows"]}
    assert all(ten[n] < one[n] for n in one)  # faster, not slower
    assert docs["10"]["meta"]["profile"]["step_s"] == pytest.approx(docs["1"]["meta"]["profile"]["step_s"] / 10)
    for r in docs["10"]["rows"] + [docs["10"]["meta"]]:
        assert (r["compute"], r["compute_spec"], r["compute_device"], r["compute_speedup"]) == \
            ("emulated", "h100", "h100", 10.0)
        assert r["compute_label"].startswith("emulated compute: h100 (") and "compute x10 as fast" in r["compute_label"]
    fig = figure(docs["10"]["rows"], docs["10"]["meta"]["compute_label"])
    fig.canvas.draw()
    assert fig._suptitle.get_text() == docs["10"]["meta"]["compute_label"]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["1", "2", "4"]  # not 10^0-style labels


def test_bad_arguments_are_refused_from_the_command_line():
    proc = run("--model", "mlp", "--nodes", "0")
    assert proc.returncode == 2 and "--nodes" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
