"""`mpitrain simulate --validate`: the simulator against measured runs (the grid, its checks, its agreement, its report)."""

from __future__ import annotations

import json
import os

import pytest

from conftest import ROOT
from mpicomm.emulation import netns
from test_simulate_job import run


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
    assert doc["meta"]["calibration"]["tcp_wmem_max"] > 0  # the eager links' send buffer, from where it ran
    assert (tmp_path / "profiles" / "mlp-b8-r2.json").exists() and (tmp_path / "val-measured-2r.json").exists()
    assert "mean |error|" in proc.stdout and "worst " in proc.stdout and "speed-ups within 3 points" in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    (sped,) = doc["meta"]["speedups"]  # wfbp over allreduce
    assert sped["strategy"] == "wfbp" and doc["meta"]["verdict"]["ratios"] == 1
    (ranked,) = doc["meta"]["rankings"]  # one configuration: mlp, 1gbit, 2 ranks
    assert (ranked["model"], ranked["bandwidth"], ranked["ranks"], ranked["pairs"]) == ("mlp", "1gbit", 2, 1)
    assert "ranking, mlp 1gbit 2 ranks: " in proc.stdout


def test_each_host_count_is_simulated_on_the_transport_calibrated_between_that_many_hosts():
    from jobs.sim.validate import emulated_cluster

    def cal(efficiency, latency):
        return {"transport": {"rate": 4e8, "cpu_per_byte": 1e-9, "latency": latency, "efficiency": 0.94},
                "efficiency": {"1gbit": efficiency}, "cpu_per_byte": {"1gbit": 4e-9}}
    doc = {**cal(0.96, 40e-6), "hosts": {"4": cal(0.96, 40e-6), "8": cal(0.92, 80e-6)}}
    eight, four = emulated_cluster(8, "1gbit", doc, 2.0), emulated_cluster(4, "1gbit", doc, 2.0)
    assert (eight.efficiency, eight.latency) == (0.92, 80e-6) and (four.efficiency, four.latency) == (0.96, 40e-6)
    # A count not calibrated (and an older document, without "hosts") takes the top level.
    assert emulated_cluster(6, "1gbit", doc, 2.0).efficiency == 0.96
    assert emulated_cluster(8, "1gbit", cal(0.9, 1e-5), 2.0).efficiency == 0.9
    # The links' token bucket is tc tbf's (2 ms at 1 Gbit/s); a pipeline's streams take what a chain of them got.
    assert eight.burst == 250_000
    doc["hosts"]["8"]["stream_efficiency"] = {"1gbit": 0.95}
    assert emulated_cluster(8, "1gbit", doc, 2.0, streams=True).efficiency == 0.95
    assert emulated_cluster(4, "1gbit", doc, 2.0, streams=True).efficiency == 0.96  # not calibrated: the ring's
    # An older document: the probe's pair rate in its raw figures (its top level's, which every count takes).
    old = {**cal(0.7, 1e-5), "raw": {"none": {"ranks": 8}, "1gbit": {"rate": 0.9 * 125e6}}}
    assert emulated_cluster(8, "1gbit", old, 2.0, streams=True).efficiency == pytest.approx(0.9)
    old["raw"]["1gbit"]["chain_rate"] = 0.96 * 125e6  # a calibration since the chain probe
    assert emulated_cluster(8, "1gbit", old, 2.0, streams=True).efficiency == pytest.approx(0.96)
    assert emulated_cluster(8, "1gbit", old, 2.0).efficiency == 0.7


def _ranked(strategy, measured, simulated, rounds):
    return dict(model="m", bandwidth="1gbit", ranks=4, strategy=strategy, measured_s=measured, simulated_s=simulated,
                error=(simulated - measured) / measured, measured_rounds_s=rounds)


def test_rankings_count_only_the_pairs_the_measured_rounds_order():
    from jobs.sim.agreement import rankings

    rows = [_ranked("compute", 1.0, 1.0, []),
            _ranked("a", 1.0, 1.2, [0.99, 1.01]),  # a and b: rounds apart, order swapped by the simulation
            _ranked("b", 1.5, 1.1, [1.49, 1.51]),
            _ranked("c", 1.52, 2.0, [1.45, 1.60])]  # c's rounds overlap b's: no measured order between them
    (k,) = rankings(rows)
    assert k["pairs"] == 3 and not k["same_order"]
    assert k["separated"] == 2 and k["swapped"] == ["a/b"]  # a/c is ordered alike; b/c is not counted
    rows[1]["simulated_s"] = 1.0
    assert rankings(rows)[0]["swapped"] == [] and rankings(rows)[0]["same_order"]


def test_speedups_are_over_the_baseline_in_points_beside_the_rounds_own_span():
    from jobs.sim.agreement import speedups, verdict, verdict_lines, rankings

    rows = [_ranked("compute", 1.0, 1.0, []),
            _ranked("allreduce", 2.0, 2.0, [1.9, 2.1]),
            _ranked("a", 1.0, 1.05, [1.0, 1.0]),  # measured 2.00 (rounds 1.90, 2.10); simulated 1.905: -9.5 points
            _ranked("b", 1.6, 1.6, [1.52, 1.68])]  # measured 1.25 in both rounds, simulated 1.25: 0 points
    rows += [dict(r, bandwidth="10gbit") for r in rows[:3]]  # a second configuration
    rows += [dict(r, model="other") for r in rows[2:4]]  # a third without the baseline: no ratios
    sped = speedups(rows)
    assert [(s["bandwidth"], s["strategy"]) for s in sped] == [("1gbit", "a"), ("1gbit", "b"), ("10gbit", "a")]
    a, b, _ = sped
    assert a["measured"] == pytest.approx(2.0) and a["simulated"] == pytest.approx(2.0 / 1.05)
    assert a["error_points"] == pytest.approx(100 * (2.0 / 1.05 - 2.0))
    assert a["measured_rounds"] == pytest.approx([1.9, 2.1]) and a["measured_span_points"] == pytest.approx(20)
    assert a["inside"] is True  # 1.905 lies within the rounds' 1.90-2.10
    assert b["error_points"] == pytest.approx(0) and b["inside"] is True
    v = verdict(rows, rankings(rows), sped)
    assert (v["ratios"], v["ratios_within"], v["ratios_resolved"], v["ratios_inside"]) == (3, 1, 1, 3)
    assert v["worst_error"] == pytest.approx(0.05) and v["within_10"] == v["rows"] == 7
    text = "\n".join(verdict_lines(v, sped))
    assert "speed-ups within 3 points: 1 of 3: missed" in text and "a ÷ allreduce: simulated 1.90" in text
    assert "worst +5.0 %" in text and "within 10 %: met" in text


@pytest.mark.cluster
@pytest.mark.skipif(netns.why_not() is not None, reason=f"{netns.why_not()}")
@pytest.mark.timeout(900)
def test_validate_under_emulated_compute_simulates_each_row_from_its_compute_model(tmp_path):
    """No profile is taken: each carried, emulated row is simulated from the device model its run waited on."""
    out = tmp_path / "val.json"
    # The transport as measured here once (the test above measures it anew): this test measures the runs only.
    cal = os.path.join(ROOT, "benchmarks", "issue15", "validation-4r-calibration.json")
    proc = run("--validate", "--compute", "emulated:v100", "--ranks", "2", "--bandwidths", "2gbit", "--carry-at",
               "1gbit", "--models", "mlp", "--strategies", "allreduce,wfbp", "--batch-size", "8", "--rounds", "1",
               "--batches", "1", "--warmup", "1", "--profiles", str(tmp_path / "profiles"), "--calibration", cal,
               "--json", str(out), timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not (tmp_path / "profiles").exists()
    rows = json.loads(out.read_text())["rows"]
    assert {r["strategy"] for r in rows} == {"compute", "allreduce", "wfbp"}
    assert {r["bandwidth"] for r in rows} == {"2gbit"}
    for r in rows:
        assert r["measured_s"] > 0 and r["simulated_s"] > 0
    measured = json.loads((tmp_path / "val-measured-2r.json").read_text())["rows"]
    assert {(r["compute_spec"], r["carry_factor"], r["carried_links"]) for r in measured} == {("v100", 2.0, "1gbit")}


def test_a_pipeline_benchmark_row_is_simulated_on_its_own_split_and_micro_batch():
    """jobs.bench.pipeline's rows: a pipeline mode by its balance over the model's chain (the simulator's layers
    are the units each stage calls, parameters or not), profiled at the micro-batch; torch-1f1b has no schedule."""
    from jobs.sim.modelled import pipeline_row, row_profile
    from runtime.sim import Cluster, simulate

    row = dict(model="fc-heavy", contender="vanilla", kind="pipeline", ranks=4, batch=64, microbatches=8,
               balance=[3, 1, 2, 4], bandwidth="1gbit", compute_spec="v100", compute_scale=1.0)
    out = pipeline_row(row)
    assert out["strategy"] == "pipeline-vanilla" and out["batch_per_rank"] == 8 and out["every_unit"]
    assert out["sim_options"] == {"microbatches": 8, "balance": [3, 1, 2, 4], "per_microbatch": True}
    # Flatten, Linear, ReLU, ... : a layer per unit, so a stage may start at a ReLU, or be one
    prof = row_profile(out)
    assert len(prof.layers) == 10 and prof.layers[0].elements == 0 and prof.layers[1].elements > 0
    vgg = pipeline_row(dict(row, model="vgg19", ranks=8, balance=[10, 9, 1, 1, 1, 1, 1, 19]))
    assert vgg["sim_options"]["balance"] == [10, 9, 1, 1, 1, 1, 1, 19]
    r = simulate(row_profile(vgg), Cluster(nodes=8), "pipeline-vanilla", **vgg["sim_options"])
    assert r.t_iter_s > 0 and len(r.details["stages"]) == 8
    # A row that says how long its sends held each stage's host: drawn, the step the mean of SEEDS runs.
    from runtime.sim.pipeline import SEEDS
    sends = [{"act": [0.001, 0.002], "grad": None}] + [{"act": [0.001, 0.002], "grad": [0.001, 0.003]}] * 2 + \
        [{"act": None, "grad": [0.001, 0.003]}]
    held = pipeline_row(dict(row, send_host_s=sends))["sim_options"]
    assert held == dict(out["sim_options"], send_host=sends, seeds=SEEDS) and SEEDS > 1
    assert simulate(prof, Cluster(nodes=4), "pipeline-vanilla", **held).t_iter_s > \
        simulate(prof, Cluster(nodes=4), "pipeline-vanilla", **out["sim_options"]).t_iter_s
    # ... and how long each op held it beyond the emulated device's sleeps: drawn too, the longer of the two
    ops = [{"F": [0.001, 0.004], "B": [0.002, 0.003], "U": [0.0005, 0.001]}] * 4
    both = pipeline_row(dict(row, send_host_s=sends, op_host_s=ops))["sim_options"]
    assert both == dict(held, op_host=ops)
    assert simulate(prof, Cluster(nodes=4), "pipeline-vanilla", **both).t_iter_s > \
        simulate(prof, Cluster(nodes=4), "pipeline-vanilla", **held).t_iter_s
    dp = pipeline_row(dict(row, contender="wfbp", kind="data-parallel", microbatches=None, balance=None))
    assert dp["strategy"] == "wfbp" and dp["batch_per_rank"] == 16 and "sim_options" not in dp
    assert pipeline_row(dict(row, contender="torch-1f1b", kind="peer")) is None


@pytest.mark.parametrize("args,message", [
    (["--models", "foo"], "--models: unknown 'foo'"),
    (["--pipeline-models", "resnet50"], "--pipeline-models: unknown 'resnet50'"),
    (["--bandwidths", "1gbt"], "--bandwidths: cannot parse bandwidth '1gbt'"),
    (["--strategies", "bogus"], "--strategies: unknown 'bogus'"),
    (["--strategies", "allreduce,pipeline-gpipe"], "--strategies: unknown 'pipeline-gpipe'"),
    (["--ranks", "4,999"], "--ranks: each is a host of one rank: at most "),
    (["--baseline", "zzz"], "--baseline: 'zzz' is not among --strategies"),
    (["--strategies", "wfbp,p3", "--baseline", "allreduce"], "--baseline: 'allreduce' is not among --strategies"),
], ids=["model", "pipeline-model", "bandwidth", "strategy", "pipeline-mode", "ranks", "baseline", "baseline-absent"])
def test_validate_refuses_a_bad_grid_before_any_stage(args, message, capsys):
    """Calibration takes minutes on the emulated cluster: a name jobs.bench would refuse is refused first."""
    from jobs.sim.validate import parse_args

    with pytest.raises(SystemExit) as exit:
        parse_args(["--ranks", "2", *args])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_validate_takes_the_first_strategy_as_baseline_without_allreduce():
    from jobs.sim.validate import parse_args

    assert parse_args(["--strategies", "pipeline-flush,pipeline-vanilla"]).baseline == "pipeline-flush"
    assert parse_args(["--strategies", "wfbp,allreduce"]).baseline == "allreduce"


def test_validate_takes_carried_links_under_emulated_compute():
    """--carry-at reads --bandwidths as a list: the early grid check once handed it the string (its characters,
    "2", refused as a rate) and refused every carried grid."""
    from jobs.sim.validate import parse_args

    args = parse_args(["--compute", "emulated:v100", "--bandwidths", "2gbit,4gbit", "--carry-at", "1gbit",
                       "--models", "mlp", "--strategies", "allreduce,wfbp"])
    assert args.bandwidths == ["2gbit", "4gbit"] and args.carry_at_bps == 1e9


def test_a_failed_measurement_stops_the_validation_with_one_line(tmp_path):
    """jobs.bench's status is checked: a failed sweep (exit 1, its rows kept) stops here, not in a traceback."""
    from jobs.sim.validate import MeasureFailed, check_status

    check_status("jobs.bench", 2, 0, str(tmp_path / "none.json"))  # it ran: on to its rows
    with pytest.raises(MeasureFailed, match=r"^jobs.bench on 2 ranks failed \(exit 1\)$"):
        check_status("jobs.bench", 2, 1, str(tmp_path / "none.json"))
    (tmp_path / "kept.json").write_text("{}")
    with pytest.raises(MeasureFailed, match="failed \\(exit 1\\); the rows it measured: .*kept.json"):
        check_status("jobs.bench", 2, 1, str(tmp_path / "kept.json"))


def test_validation_rows_and_figure_name_their_compute_and_the_machine():
    from jobs.common.report import machine, machine_line
    from jobs.sim.validate import _row, figure_title

    measured = dict(model="mlp", strategy="wfbp", bandwidth="1gbit", ranks=2, t_iter_rounds_s=[1.0])
    real = _row(measured, "wfbp", 1.0, 1.1, 1.1, 0.0)
    emulated = _row(dict(measured, compute="emulated (V100)", compute_device="v100", compute_scale=10.0), "wfbp",
                    1.0, 1.1, 1.1, 0.0)
    assert (real["compute"], real["compute_device"], real["compute_scale"]) == ("real", None, 1.0)
    assert (emulated["compute"], emulated["compute_device"], emulated["compute_scale"]) == ("emulated (V100)", "v100",
                                                                                          10.0)
    assert figure_title([real, emulated]).split("\n")[1:] == ["compute: real, emulated (V100) x10",
                                                              machine_line(machine())]
