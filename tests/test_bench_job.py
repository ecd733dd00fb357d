"""jobs.bench runs every strategy side by side and writes its table, JSON and plot (here: tiny, unshaped)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, another_congestion_control, exit_in_process
from mpicomm.emulation import netns
from mpicomm.launch import mpiexec


def test_local_bench_rows_table_and_plot(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "jobs.bench", "--local", "--hosts", "2", "--models", "mlp", "--batch-size", "8",
           "--batches", "1", "--iters", "1", "--warmup", "1", "--rounds", "2", "--threads", "2", "--json", str(out),
           "--strategies", "allreduce,wfbp,p3,ddp,p3@2048/2,hybcomm-sfb"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["strategy"] for r in rows] == ["allreduce", "wfbp", "p3", "ddp", "p3@2048/2", "hybcomm-sfb"]
    hybrid = rows.pop()
    # Its factors exist only inside a backward pass: no T_comm of its own, and the table says so.
    assert hybrid["t_comm_s"] is None and hybrid["overlap_efficiency"] is None and hybrid["samples_per_s"] > 0
    assert hybrid["t_comm_rounds_s"] is None and hybrid["overlap_rounds"] is None and hybrid["comm_cpu_s"] is None
    assert "| mlp | hybcomm-sfb | local-unshaped |" in proc.stdout
    # The worker's progress, shown as it ran (before the table): each contender of each round.
    progress = [line for line in proc.stdout.splitlines() if line.startswith("  # ") and ": round " in line]
    assert len(progress) == 2 * 7 and proc.stdout.index(progress[-1]) < proc.stdout.index("| mlp | allreduce |")
    assert any("round 2/2 p3@2048/2: T_iter" in line for line in progress)
    plan = proc.stdout[proc.stdout.index("hybcomm plan, mlp at local-unshaped (hybcomm-sfb):"):]
    assert "| net.1 | 784 | 256 | 8 | sfb | forced |" in plan and "| net.3 | 256 | 10 | 8 | sfb | forced |" in plan
    keys = {"model", "strategy", "bandwidth", "ranks", "samples_per_s", "ci", "t_iter_s", "t_compute_s", "t_comm_s",
            "t_iter_ci", "t_compute_ci", "t_comm_ci", "overlap_efficiency", "compute_cpu_s", "comm_cpu_s"}
    for r in rows:
        assert keys <= set(r) and r["ranks"] == 2 and r["bandwidth"] == "local-unshaped"
        assert r["nodes"] == 2  # --local honours --hosts: one emulated node per host
        assert r["device"] == "cpu" and r["transport"]  # --device's default, forwarded to the worker
        assert r["rounds"] == 2 and r["threads"] == 2
        assert r["samples_per_s"] > 0 and r["t_iter_s"] > 0 and r["t_comm_s"] > 0
        for key in ("t_iter", "t_compute", "t_comm", "compute_cpu", "comm_cpu", "overlap", "hidden_share"):
            per_round = r[f"{key}_rounds" + ("" if key in ("overlap", "hidden_share") else "_s")]
            median = r[{"overlap": "overlap_efficiency", "hidden_share": "hidden_share"}.get(key, f"{key}_s")]
            assert len(per_round) == 2 and median == statistics.median(per_round), (key, r)
        for key in ("t_iter", "t_compute", "t_comm"):  # two rounds: the CI is their range (a 50 % one)
            assert r[f"{key}_ci"] == [min(r[f"{key}_rounds_s"]), max(r[f"{key}_rounds_s"])]
        assert r["ci_coverage"] == 0.5
        # Each round's overlap comes from that round's own three times, and never leaves [0, 1].
        for c, m, i, o, h in zip(r["t_compute_rounds_s"], r["t_comm_rounds_s"], r["t_iter_rounds_s"],
                                 r["overlap_rounds"], r["hidden_share_rounds"]):
            assert 0 < o <= 1 and o == min(1.0, max(c, m) / i)
            assert 0 <= h <= 1 and h == min(1.0, max(0.0, (c + m - i) / min(c, m)))
        assert 0 < r["overlap_efficiency"] <= 1 and 0 <= r["hidden_share"] <= 1
        assert [sum(b) / len(b) for b in r["t_iter_batches_s"]] == r["t_iter_rounds_s"]
        lo, hi = r["samples_per_s_ci"]
        assert abs(r["samples_per_s"] - 16 / r["t_iter_s"]) < 1e-6 and lo <= r["samples_per_s"] <= hi
        assert abs(lo - 16 / r["t_iter_ci"][1]) < 1e-6 and abs(hi - 16 / r["t_iter_ci"][0]) < 1e-6
        assert r["ci"] == max(hi - r["samples_per_s"], r["samples_per_s"] - lo)
        # The plain step's rounds are shared: each strategy's overlap uses the same T_compute of its round.
        assert r["t_compute_rounds_s"] == rows[0]["t_compute_rounds_s"]
        # No interface per host here: nothing to count, and nothing made up.
        assert r["wire_bytes_per_step"] is None and r["wire_bytes_per_host_per_step"] is None
    # p3's contenders say what they ran with and count what it cost: the variant's settings as given.
    auto, variant = rows[2], rows[4]
    assert "(auto)" in auto["p3_settings"] and "slice 2048 elements" in variant["p3_settings"]
    assert "credit 2 (given)" in variant["p3_settings"] and f"| {variant['strategy']} |" in proc.stdout
    # the MLP's 0.2 M gradients: one smallest slice (64 Ki elements) fewer messages than 2048-element ones
    assert 0 < auto["p3_messages_per_step"] < variant["p3_messages_per_step"]
    assert auto["p3_polls_per_step"] > 0 and "p3@2048/2, mlp at local-unshaped: slice 2048" in proc.stdout
    ddp = rows[3]
    assert ddp["comm_cpu_vs_ddp"] == (1.0 if any(ddp["comm_cpu_rounds_s"]) else None)
    assert all(r["step_cpu_s"] > 0 and len(r["step_cpu_rounds_s"]) == 2 for r in rows)
    assert "| mlp | p3 | local-unshaped |" in proc.stdout and "| wire MB/step |" in proc.stdout
    assert "| comm CPU s |" in proc.stdout and "| overlap eff. | hidden share |" in proc.stdout
    assert "\ndevices: cpu; real compute\n" in proc.stdout and "\nmedian of 2 rounds " in proc.stdout
    machine = doc["meta"]["machine"]
    assert machine["cores"] == os.cpu_count() and machine["usable_cores"] == len(os.sched_getaffinity(0))
    assert doc["meta"]["rounds"] == 2 and doc["meta"]["threads"] == 2
    assert f"\nmachine: {machine['cpu_model']}, {os.cpu_count()} cores (" in proc.stdout
    assert "; 2 torch threads per rank\n" in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_a_timed_batch_is_the_steady_state_of_back_to_back_steps_without_the_final_flush(monkeypatch):
    """Time as the steps and finish() advance it (a clock of our own): each batch times its `iters` steps after a
    lead-in step, and not the finish() that waits for the last step's deferred exchange (p3's), which the
    lead-in's step left owed when the window opened too."""
    from mpi4py import MPI

    from jobs.bench import strategies_worker as w

    now, calls = [0.0], []

    def step():
        calls.append("step")
        now[0] += 1.0

    def finish():
        calls.append("finish")
        now[0] += 100.0  # the exchange of the last step, waited for
    monkeypatch.setattr(w.time, "perf_counter", lambda: now[0])
    assert w.timed_batches(MPI.COMM_SELF, step, finish, warmup=2, batches=3, iters=4) == [1.0, 1.0, 1.0]
    batch = ["step"] * w.steps_per_batch(4) + ["finish"]
    assert calls == ["step", "step", "finish"] + batch * 3 and w.steps_per_batch(4) == 5


def test_overlap_efficiency_and_the_hidden_share_of_the_shorter_phase():
    """Efficiency max/T_iter never above 1; hidden share 0 for phases back to back, 1 for the shorter wholly
    hidden; both clipped where timings alone disagree."""
    from jobs.bench.strategies_rows import hidden_share, overlap

    assert overlap(1.0, 0.5, 1.5) == pytest.approx(2 / 3) and overlap(1.0, 0.5, 1.0) == 1.0
    assert overlap(1.0, 0.5, 0.9) == 1.0  # a step faster than its longer phase alone
    assert hidden_share(1.0, 0.5, 1.5) == 0.0 and hidden_share(1.0, 0.5, 1.0) == 1.0
    assert hidden_share(0.4, 1.0, 1.2) == pytest.approx(0.5)  # 0.2 of the 0.4 s compute hidden behind comm
    assert hidden_share(1.0, 0.5, 0.9) == 1.0  # a step faster than its longer phase alone
    assert hidden_share(1.0, 0.5, 2.0) == 0.0  # slower than both phases back to back


def test_worker_rejects_unknown_strategy():
    proc = subprocess.run([sys.executable, "-m", "jobs.bench.strategies_worker", "--strategies", "p4"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "--strategies: unknown 'p4'" in proc.stderr


def test_worker_counts_wire_bytes_per_host_and_reports_hybcomms_plan():
    """Two emulated nodes told to count loopback (real traffic: gloo's TCP): both node leaders read the one counter.

    DDP's ring sends at least the gradient per step; hybcomm rows carry their plan, a forced one forced.
    """
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "jobs.bench.strategies_worker", "--model", "mlp", "--batch-size", "8",
           "--batches", "2", "--iters", "1", "--warmup", "1", "--rounds", "1", "--ranks-per-node", "1",
           "--bandwidth", "1gbit", "--strategies", "ddp,hybcomm,hybcomm-ps"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, MPITRAIN_CLUSTER_IFACE="lo"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["strategy"]: r for r in (json.loads(line[4:]) for line in proc.stdout.splitlines()
                                       if line.startswith("ROW "))}
    assert list(rows) == ["ddp", "hybcomm", "hybcomm-ps"]
    grad_bytes = (784 * 256 + 256 + 256 * 10 + 10) * 4
    for r in rows.values():
        assert r["nodes"] == 2 and r["wire_bytes_per_step"] == 2 * r["wire_bytes_per_host_per_step"]
    assert rows["ddp"]["wire_bytes_per_step"] >= grad_bytes and "plan" not in rows["ddp"]
    assert rows["ddp"]["t_comm_s"] > 0 and rows["hybcomm"]["t_comm_s"] is None
    layers = {("net.1", 784, 256), ("net.3", 256, 10)}  # the mlp's Linear layers: in, out features
    for name, forced in (("hybcomm", None), ("hybcomm-ps", "ps")):
        plan = rows[name]["plan"]
        assert {(p["name"], p["M"], p["N"]) for p in plan} == layers
        assert all(set(p) == {"name", "M", "N", "K", "choice", "reason"} and p["choice"] in ("sfb", "ps")
                   and p["K"] == 8 for p in plan)  # K: rows per rank, the batch
        assert forced is None or {p["choice"] for p in plan} == {forced}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
@pytest.mark.timeout(600)
def test_local_bench_on_cuda_runs_vgg19_and_resnet50_with_every_contender(tmp_path):
    """--device cuda reaches the worker: VGG-19 and ResNet-50 train on the GPU, DDP over gloo with CUDA tensors."""
    out = tmp_path / "bench.json"
    strategies = ["allreduce", "wfbp", "p3", "ddp"]
    cmd = [sys.executable, "-m", "jobs.bench", "--local", "--hosts", "2", "--device", "cuda", "--models",
           "vgg19,resnet50", "--batch-size", "4", "--batches", "2", "--iters", "1", "--warmup", "1",
           "--strategies", ",".join(strategies), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["strategy"]) for r in rows] == [(m, s) for m in ("vgg19", "resnet50") for s in strategies]
    assert all(r["device"] == "cuda" and r["cuda"] == torch.version.cuda and r["samples_per_s"] > 0 for r in rows)
    assert "devices: cuda (" in proc.stdout


def test_local_bench_under_emulated_compute_fills_the_compute_fields(tmp_path):
    """--compute emulated:v100 reaches every default contender (DDP included): rows, title, meta and PNG name it."""
    from runtime.emulate import compute_model
    from runtime.workloads.models import build_model

    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "jobs.bench", "--local", "--hosts", "2", "--models", "mlp", "--compute",
           "emulated:v100", "--compute-scale", "2", "--batches", "1", "--iters", "1", "--warmup", "1", "--rounds",
           "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["strategy"] for r in rows] == ["allreduce", "wfbp", "p3", "ddp"]
    params = list(build_model("mlp").parameters())
    # The optimizer's modelled update, times the scale: the step ran on the emulated accelerator.
    update = 2 * compute_model("v100").optimizer_s(sum(p.numel() for p in params), len(params), 1)
    for r in rows:
        assert r["samples_per_s"] > 0 and r["t_comm_s"] > 0 and r["batch_per_rank"] == 16  # mlp: no paper batch
        assert r["compute_device"] == "v100" and r["compute_scale"] == 2 and "v100" in r["compute"]
        assert {"layers", "optimizer"} <= set(r["emulated_parts"]) and r["compute_label"].endswith("compute x2")
        if r["strategy"] == "p3":
            # Its updates are applied in the next forward, layer by layer as each layer's slices arrive (in groups of
            # whatever has arrived): more launches than one update of everything, at most one update per tensor.
            each = sum(2 * compute_model("v100").optimizer_s(p.numel(), 1, 1) for p in params)
            # (Both bounds up to rounding: all slices in one group is one update of everything, summed otherwise.)
            assert update - 1e-12 <= r["modelled_parts_s"]["optimizer"] <= each + 1e-12
        else:
            assert r["modelled_parts_s"]["optimizer"] == pytest.approx(update)
        assert r["modelled_compute_s"] == pytest.approx(sum(r["modelled_parts_s"].values()))
        assert r["modelled_compute_s"] > r["modelled_parts_s"]["layers"] > 0
        assert r["step_cpu_s"] > 0 and r["compute_cpu_s"] > 0 and r["peak_rss_mb"] > 0
        assert r["peak_rss_ranks_mb"] >= r["peak_rss_mb"] and r["carried_at"] is None and r["carry_factor"] == 1
        assert r["ranks_per_core"] == pytest.approx(2 / len(os.sched_getaffinity(0)))
        assert (r["warmup"], r["batches"], r["iters"]) == (1, 1, 1)
    label = rows[0]["compute_label"]
    assert label.startswith("emulated compute: ") and f"\ndevices: cpu; {label}\n" in proc.stdout
    assert "| modelled s | peak RSS MB |" in proc.stdout and "carried at" not in proc.stdout
    meta = doc["meta"]
    assert meta["compute_device"] == "v100" and meta["compute_label"] == label and "layers" in meta["emulated_parts"]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"



def test_a_host_too_slow_for_the_emulated_device_is_said_once_for_all_ranks(tmp_path):
    """A device a million times faster than a V100 leaves no time to land the gradients: each rank's emulation
    warns (runtime.emulate.landing), and the bench's driver passes the warning on once, saying how many more
    ranks said the same, where it used to drop the workers' stderr."""
    cmd = [sys.executable, "-m", "jobs.bench", "--local", "--hosts", "2", "--models", "mlp", "--strategies", "p3",
           "--compute", "emulated:v100", "--compute-scale", "1e-6", "--batches", "1", "--iters", "2", "--warmup", "1",
           "--rounds", "1", "--json", str(tmp_path / "bench.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "bound by this host's memory" in line]
    assert len(said) == 1 and said[0].startswith("worker: ") and said[0].endswith("(and 1 more like it)"), proc.stderr

def test_emulated_defaults_per_model_and_given_values_win():
    """Under emulation: the paper's batch, and few steps for a model of hundreds of MB per step; else as always."""
    from jobs.bench.strategies import parse_args, run_settings

    emulated = parse_args(["--local", "--compute", "emulated:h100"])
    assert run_settings(emulated, "vgg19-224") == dict(batch_size=32, batches=2, iters=1, warmup=1, rounds=2)
    assert run_settings(emulated, "mlp") == dict(batch_size=16, batches=5, iters=2, warmup=2, rounds=3)
    real = parse_args(["--local"])
    assert run_settings(real, "vgg19-224") == dict(batch_size=16, batches=5, iters=2, warmup=2, rounds=3)
    given = parse_args(["--local", "--compute", "emulated:h100", "--batch-size", "4", "--batches", "3"])
    assert run_settings(given, "vgg19-224") == dict(batch_size=4, batches=3, iters=1, warmup=1, rounds=2)


@pytest.mark.parametrize("args,message", [
    (["--bandwidths", "10gbit", "--carry-at", "1gbit"], "--carry-at: scales the compute with the links: it needs "
                                                        "--compute emulated:DEVICE"),
    (["--local", "--carry-at", "1gbit", "--compute", "emulated:v100"], "--carry-at: --local runs unshaped"),
    (["--bandwidths", "10gbit,none", "--carry-at", "1gbit", "--compute", "emulated:v100"],
     "--carry-at: --bandwidths none is unshaped"),
    (["--local", "--compute", "emulated:nonesuch"], "--compute: unknown device 'nonesuch'; named devices: 1080ti, h100,"),
    (["--local", "--compute-scale", "2"], "--compute-scale: applies to emulated compute only"),
])
def test_bad_compute_and_carry_are_one_line_and_exit_2(args, message, capsys):
    from jobs.bench.strategies import main

    code, out, err = exit_in_process(main, args, capsys)
    assert code == 2 and err.startswith(f"error: {message}"), err
    assert err.count("\n") == 1 and out == ""


def test_carried_rows_are_reported_at_the_bandwidth_asked():
    """Times divided, rates multiplied by B / RATE; CPU-seconds and bytes as measured; the carrying said."""
    from types import SimpleNamespace

    from jobs.common import carry

    args = SimpleNamespace(carry_at="1gbit", carry_at_bps=10 ** 9)
    rows = [dict(t_iter_s=2.0, t_iter_ci=[1.0, 4.0], parts=dict(layers=1.0), samples_per_s=8.0, step_cpu_s=3.0,
                 wire_bytes_per_step=100, t_comm_s=None)]
    carry.report_at(args, rows, "10gbit", ("t_iter_s", "t_iter_ci", "parts", "t_comm_s"), ("samples_per_s",))
    assert rows == [dict(t_iter_s=0.2, t_iter_ci=[0.1, 0.4], parts=dict(layers=0.1), samples_per_s=80.0,
                         step_cpu_s=3.0, wire_bytes_per_step=100, t_comm_s=None, carry_factor=10.0,
                         carried_at="1 Gbit/s links, compute x10", carried_links="1gbit")]
    assert "carried at 1 Gbit/s links" in carry.title_line(args)
    plain = [dict(t_iter_s=2.0)]
    carry.report_at(SimpleNamespace(), plain, "local-unshaped", ("t_iter_s",), ())
    assert plain == [dict(t_iter_s=2.0, carried_at=None, carry_factor=1.0, carried_links="local-unshaped")]


@pytest.mark.cluster
@pytest.mark.skipif(netns.why_not() is not None, reason=f"{netns.why_not()}")
@pytest.mark.timeout(300)
def test_carry_at_runs_on_slower_links_and_reports_at_the_bandwidth_asked(tmp_path):
    """2 Gbit/s carried at 1: the links shaped to 1 Gbit/s, compute x2; the rows at 2gbit, the x2 divided back.
    With --congestion-control, the hosts' TCP as asked, in each row."""
    from runtime.emulate import compute_model
    from runtime.workloads.models import build_model

    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "jobs.bench", "--hosts", "2", "--models", "mlp", "--bandwidths", "2gbit",
           "--carry-at", "1gbit", "--compute", "emulated:v100", "--strategies", "allreduce", "--batches", "1",
           "--iters", "1", "--warmup", "1", "--rounds", "1", "--json", str(out)]
    tcp = another_congestion_control() or netns.congestion_control()
    proc = subprocess.run([*cmd, "--congestion-control", tcp], capture_output=True, text=True, cwd=ROOT, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["congestion_control"] == tcp
    assert (row["bandwidth"], row["carried_links"], row["carry_factor"]) == ("2gbit", "1gbit", 2.0)
    assert row["carried_at"] == "1 Gbit/s links, compute x2" and row["compute_scale"] == 1.0
    params = list(build_model("mlp").parameters())
    update = compute_model("v100").optimizer_s(sum(p.numel() for p in params), len(params), 1)
    assert row["modelled_parts_s"]["optimizer"] == pytest.approx(update)  # ran x2, reported at 2gbit: x1
    assert row["samples_per_s"] == pytest.approx(2 * 16 / row["t_iter_s"])
    assert row["wire_bytes_per_step"] >= 4 * sum(p.numel() for p in params)  # bytes as measured
    assert "\ncarried at 1 Gbit/s links: " in proc.stdout and "| 1 Gbit/s links, compute x2 |" in proc.stdout


@pytest.mark.timeout(120)
def test_a_sweep_whose_run_failed_exits_1_not_the_bad_input_2(tmp_path):
    """Nothing measured because the run failed (here, timed out): exit 1, said in one error line; 2 is bad input."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "jobs.bench", "--local", "--hosts", "2", "--models", "mlp",
                           "--strategies", "allreduce", "--rounds", "1", "--batches", "1", "--iters", "1", "--warmup",
                           "0", "--timeout", "1", "--json", str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: job timed out" in proc.stderr and not out.exists()


def test_the_figures_title_names_the_compute_the_machine_and_a_failed_run():
    from jobs.bench.strategies import figure_title, parse_args
    from jobs.common.report import machine, machine_line

    args = parse_args(["--local", "--hosts", "2", "--models", "mlp", "--strategies", "allreduce"])
    assert figure_title(args, []).split("\n") == ["real compute", machine_line(machine())]
    failed = [dict(run="resnet50", bandwidth="local-unshaped", ranks=2, error="job timed out")]
    assert figure_title(args, failed).split("\n")[0] == "INCOMPLETE: resnet50 at local-unshaped, 2 ranks failed"
