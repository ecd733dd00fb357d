"""jobs.hybcomm_plan end to end (no MPI): the plan of a model's Linear layers, refused layers, JSON, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, exit_in_process


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.hybcomm_plan", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_vgg19_22k_sends_the_head_as_factors(tmp_path):
    out = tmp_path / "plan.json"
    proc = _run("--model", "vgg19-22k", "--batch-size", "8", "--ranks", "8", "--ranks-per-node", "2",
                "--gflops", "50", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "P = 8 ranks, 2 per node, 4 nodes" in proc.stdout
    assert "| classifier.5 | 4096×21841 | 8 | sfb |" in proc.stdout
    for name in ("classifier.1", "classifier.3"):
        assert any(line.startswith(f"| {name} |") and ("| sfb" in line or "| ps" in line)
                   for line in proc.stdout.splitlines())
    assert "fewer bytes than all-PS" in proc.stdout
    doc = json.loads(out.read_text())
    assert [layer["name"] for layer in doc["layers"]] == ["classifier.1", "classifier.3", "classifier.5"]
    head = doc["layers"][2]
    assert (head["M"], head["N"], head["K"], head["choice"]) == (4096, 21841, 8, "sfb")
    assert doc["meta"]["gflops"] == 50 and doc["meta"]["nodes"] == 4 and not doc["meta"]["gflops_measured"]
    assert doc["dense_bytes"] > 0 and doc["totals"]["plan_bytes"] < doc["totals"]["all_ps_bytes"]
    assert doc["refused"] == {}


def test_transformer_lists_out_proj_and_the_tied_output_as_refused():
    proc = _run("--model", "transformer", "--batch-size", "2", "--ranks", "4", "--gflops", "50")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table, _, refused = proc.stdout.partition("refused (dense path):")
    assert "| transformer.encoder.layers.0.linear1 | 256×1024 |" in table
    assert "out_proj" not in table and "| out |" not in table
    assert "transformer.encoder.layers.0.self_attn.out_proj: its weight is used without calling the layer" in refused
    assert "  out: tied weight" in refused


@pytest.mark.parametrize("args, option", [
    (("--model", "nope"), "--model"),
    (("--batch-size", "0"), "--batch-size"),
    (("--ranks", "0"), "--ranks"),
    (("--ranks", "8", "--ranks-per-node", "3"), "--ranks-per-node"),
    (("--bandwidth", "fast"), "--bandwidth"),
    (("--intra-bandwidth", "none"), "--intra-bandwidth"),
    (("--gflops", "0"), "--gflops"),
    (("--force", "fastest"), "--force"),
])
def test_bad_input_is_one_line_and_exit_2(args, option, capsys):
    # In this process: a subprocess would spend its time importing torch for the bandwidth checks.
    from jobs.hybcomm_plan import parse_args

    code, out, err = exit_in_process(parse_args, list(args), capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"error: {option}:") and len(err.strip().splitlines()) == 1


def test_bad_input_exits_2_from_the_command_line():
    proc = _run("--ranks", "8", "--ranks-per-node", "3")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == "error: --ranks-per-node: 3 does not divide --ranks 8\n" and proc.stdout == ""
