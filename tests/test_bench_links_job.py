"""jobs.bench.links on the emulated cluster (as root): rows per link and bucket, the rounds interleaved; bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, exit_in_process
from mpicomm.emulation import link_burst, netns

JOB = [sys.executable, "-m", "jobs.bench.links"]


def run(*args, timeout=300):
    return subprocess.run([*JOB, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


@pytest.mark.cluster
@pytest.mark.skipif(netns.why_not() is not None, reason=f"{netns.why_not()}")
def test_each_link_and_bucket_is_probed_every_round(tmp_path):
    if netns.our_namespaces():
        pytest.fail(f"namespaces {netns.our_namespaces()} exist already: `python -m jobs.cluster down` first")
    out = tmp_path / "links.json"
    # 1 Gbit/s: the probes take a quarter of 250 Mbit/s's time (the slower links' buckets: test_cluster.py).
    proc = run("--hosts", "2", "--bandwidths", "1gbit", "--bursts", "default,300000", "--rounds", "2",
               "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # Interleaved, the second round in reverse: a change in the machine's load moves both alike.
    starts = [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("# round")]
    assert starts == ["2 hosts at 1gbit, bucket default ...", "2 hosts at 1gbit, bucket 300000 ...",
                      "2 hosts at 1gbit, bucket 300000 ...", "2 hosts at 1gbit, bucket default ..."]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["bandwidth"], r["burst"], r["burst_bytes"]) for r in rows] == [
        ("1gbit", "default", link_burst(1_000_000_000)), ("1gbit", 300000, 300000)]
    for r in rows:
        assert r["rounds"] == 2 and r["latency_s"] > 0
        for name in ("pair", "ring", "chain", "two_way"):
            # A share of the shaped rate: not the unshaped veth's ~40x it.
            assert len(r[f"{name}_rounds"]) == 2 and 0 < r[name] < 1.5, (name, r)
    assert doc["meta"]["compute"].startswith("none") and "| 1gbit | 300000 |" in proc.stdout
    assert (tmp_path / "links.png").stat().st_size > 0
    assert netns.our_namespaces() == []  # every cluster came down again


@pytest.mark.parametrize("args, message", [
    (["--local"], "--local: the links are what this benchmark measures"),
    (["--bursts", "1000"], "--bursts: '1000': a bucket is default or a whole number of bytes >= the MTU"),
    (["--bandwidths", "none"], "--bandwidths: none has no token bucket"),
    (["--hosts", "1"], "--hosts: must be between 2"),
])
def test_bad_input_is_one_line_before_any_cluster(args, message, capsys):
    # In this process: a subprocess would spend its time importing torch (mpicomm) for the checks.
    from jobs.bench.links import parse_args

    code, out, err = exit_in_process(parse_args, args, capsys)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, err


def test_bad_input_exits_2_from_the_command_line():
    proc = run("--rounds", "0", timeout=120)
    assert proc.returncode == 2 and "--rounds: must be between 1" in proc.stderr, proc.stderr
