"""make gpu-check (jobs.gpu_check) on the CPU: no GPU, one line and exit 2; the parts' runner and the report, with
real commands (a pytest run, a command that fails, one that outruns its limit) and a real benchmark's JSON."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import pytest
import torch

from conftest import exit_in_process
from jobs.gpu_check.main import main, run_all
from jobs.gpu_check import xcheck
from jobs.gpu_check.parts import box_parts, gpu_slug, paper_batches
from jobs.gpu_check.pytest_log import none_passed
from jobs.gpu_check.report import summarize
from jobs.gpu_check.parts import ROOT
from jobs.gpu_check.runner import Part, Result

PY = sys.executable
TESTS = """
import pytest

def test_one():
    pass

def test_two():
    assert 1 == 2

@pytest.mark.skip(reason="as a gpu test without a GPU")
def test_skipped():
    pass
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a CUDA device here")
def test_without_a_gpu_it_stops_at_once_with_one_line_and_exit_2(tmp_path, capsys):
    code, out, err = exit_in_process(main, ["--out", str(tmp_path / "run")], capsys)
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and "gpu-check needs a CUDA device" in err and torch.__version__ in err, err
    assert not (tmp_path / "run").exists()


def test_every_part_runs_whatever_the_others_do_and_the_report_says_which_failed(tmp_path):
    (tmp_path / "test_tiny.py").write_text(TESTS)
    write = "open('out.txt', 'w').write('x'); print('wrote it')"
    pytest = [PY, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-c", os.devnull,
              str(tmp_path / "test_tiny.py")]
    parts = [
        Part("tests", "a real pytest run, one test failing", pytest, 60, "pytest", check=none_passed),
        Part("skips", "every test it selects skips", [*pytest, "-k", "skipped"], 60, "pytest", check=none_passed),
        Part("slow", "outruns its limit", [PY, "-c", "import time; print('started', flush=True); time.sleep(60)"], 1.5),
        Part("writes", "exits 0 and writes its output", [PY, "-c", write.replace("out.txt", str(tmp_path / "o.txt"))],
             30, outputs=("o.txt",)),
        Part("forgets", "exits 0 without its output", [PY, "-c", "pass"], 30, outputs=("missing.json",)),
    ]
    said = []
    start = time.monotonic()
    results = run_all(parts, str(tmp_path), {"gpu": "none (test)"}, 600, said.append, min_start_s=1.0,
                      heartbeat_s=0.5)
    assert time.monotonic() - start < 50  # the slow part was ended at its limit, not after its 60 s
    status = {r.name: r.status for r in results}
    assert status == {"tests": "failed", "skips": "failed", "slow": "timed out", "writes": "passed",
                      "forgets": "failed"}, \
        [(r.name, r.status, r.problem, r.seconds) for r in results]
    assert any(line.startswith("  slow: ") for line in said), said  # progress while it ran

    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["failed"] == ["tests", "skips", "slow", "forgets"] and not doc["passed"] and doc["complete"]
    tests, skips = doc["parts"][:2]
    assert "1 failed, 1 passed" in tests["summary"] and "FAILED" in tests["summary"] and "test_two" in tests["summary"]
    assert skips["returncode"] == 0 and "no test passed (1 skipped, 2 deselected" in skips["problem"], skips
    assert "wrote it" in (tmp_path / doc["parts"][3]["log"]).read_text()
    assert "KeyboardInterrupt" in (tmp_path / doc["parts"][2]["log"]).read_text()  # ended as by ^C: jobs clean up
    md = (tmp_path / "report.md").read_text()
    assert "FAILED: tests, skips, slow, forgets" in md and "| writes | passed |" in md
    assert "did not write missing.json" in md and "[logs/slow.log](logs/slow.log)" in md


def test_a_part_left_without_budget_is_reported_not_run(tmp_path):
    [late] = run_all([Part("late", "no time left", [PY, "-c", "open('ran', 'w')"], 30)], str(tmp_path), {}, 5.0,
                     min_start_s=10.0)
    assert late.status == "not run" and "5 s of the run's time budget left" in late.problem
    assert not (tmp_path / "ran").exists() and json.loads((tmp_path / "report.json").read_text())["failed"] == ["late"]


def test_the_mstopk_figures_come_from_the_benchmarks_own_json(tmp_path, capsys):
    from jobs.bench import mstopk

    assert mstopk.main(["--sizes", "20K", "--densities", "0.01", "--repeats", "1", "--json",
                        str(tmp_path / "mstopk.json"), "--png", str(tmp_path / "mstopk.png")]) == 0
    result = Result("mstopk", "t", "mstopk", "cmd", "passed", 0, 1.0, 60, "logs/mstopk.log", outputs=("mstopk.json",))
    table = summarize(result, str(tmp_path)).splitlines()
    assert [line.split("|")[1].strip() for line in table[4:]] == ["20,000", "20,000"], table  # one per MSTopK kind
    assert all(float(line.split("|")[6]) > 0.9 for line in table[4:]), table  # the mass kept


def test_the_box_parts_cover_every_gpu_test_and_every_model_of_the_emulated_accelerators(tmp_path):
    parts = box_parts(str(tmp_path), "NVIDIA H100 80GB HBM3")
    names = [p.name for p in parts]
    assert names[:2] == ["tests-serial", "tests-mpi"] and "mstopk" in names and names[-2:] == ["throughput", "xcheck"]
    # The cross-check runs the throughput part's benchmark again, argument for argument, on this GPU's profile.
    real, cross = parts[-2].cmd, parts[-1].cmd
    assert cross[cross.index("--") + 1:] == [a for a in real[3:real.index("--json")] if a not in ("--device", "cuda")]
    assert cross[cross.index("--profile") + 1] == str(tmp_path / "profiles" / "resnet50-224-b32-h100-tf32.json")
    serial, mpi = parts[0].cmd, parts[1].cmd
    assert "mpiexec" not in " ".join(serial) and serial[serial.index("-m", 3) + 1] == "gpu and not mpi"
    assert mpi[mpi.index("-n") + 1] == "4" and mpi[-1] == "gpu and mpi"
    assert {p.name.removeprefix("profile-") for p in parts if p.kind == "profile"} == set(paper_batches())
    assert "profiles/resnet50-224-b32-h100-tf32.json" in [o for p in parts for o in p.outputs]
    assert [gpu_slug(n) for n in ("NVIDIA H200", "NVIDIA A100-SXM4-40GB", "Tesla V100-PCIE-16GB")] == \
        ["h200", "a100", "v100"]


def test_the_cross_check_reruns_the_benchmark_on_the_gpus_profile_stretched_to_the_real_compute(tmp_path):
    """The real run and the profile of the H200 lease (2026-12-04), the emulated run here on 2 local ranks: the
    emulated step is stretched to the real run's compute (its 4 ranks shared the GPU), each strategy in both runs is
    set side by side, and the report reads the table."""
    lease = os.path.join(ROOT, "benchmarks", "device", "2026-12-04")
    real = os.path.join(lease, "throughput.json")
    profile = os.path.join(lease, "profiles", "resnet50-224-b32-h200-tf32.json")
    assert xcheck.main(["--real", real, "--profile", profile, "--json", str(tmp_path / "xcheck.json"), "--",
                        "--batch-size", "32", "--local", "--hosts", "1", "--ranks-per-host", "2", "--models",
                        "resnet50-224", "--strategies", "allreduce", "--rounds", "1", "--batches", "1", "--iters", "1",
                        "--warmup", "0"]) == 0
    doc = json.loads((tmp_path / "xcheck.json").read_text())
    with open(real) as f:
        measured = json.load(f)["rows"]
    with open(profile) as f:
        step = json.load(f)["step_s"]
    assert doc["meta"]["compute_scale"] == pytest.approx(statistics.median(r["t_compute_s"] for r in measured) / step)
    [row] = doc["rows"]
    # Unstretched, the emulated compute would be half the real one (21.2 against 43.7 ms).
    assert row["strategy"] == "allreduce" and row["emulated_t_compute_s"] == pytest.approx(row["real_t_compute_s"],
                                                                                           rel=0.25)
    assert row["t_iter_ratio"] == pytest.approx(row["real_t_iter_s"] / row["emulated_t_iter_s"])
    assert (tmp_path / "xcheck-emulated.json").exists()
    result = Result("xcheck", "t", "xcheck", "cmd", "passed", 0, 1.0, 60, "logs/xcheck.log", outputs=("xcheck.json",))
    assert "| allreduce | 0.2065 |" in summarize(result, str(tmp_path))


def test_the_cross_check_names_the_pairs_that_emulation_orders_the_other_way():
    rows = [dict(strategy=s, real_t_iter_s=real, emulated_t_iter_s=emulated) for s, real, emulated in
            (("allreduce", 0.207, 0.145), ("wfbp", 0.149, 0.135), ("p3", 0.185, 0.138), ("ddp", 0.163, 0.153))]
    assert xcheck.swapped(rows) == [("allreduce", "ddp"), ("p3", "ddp")]
    assert xcheck.swapped(rows[:3]) == []
