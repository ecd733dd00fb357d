"""jobs.bench.links on the emulated cluster (as root): rows per link and bucket, the rounds interleaved; bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT
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
    proc = run("--hosts", "2", "--bandwidths", "250mbit", "--bursts", "default,70000", "--rounds", "2",
               "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # Interleaved, the second round in reverse: a change in the machine's load moves both alike.
    starts = [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("# round")]
    assert starts == ["2 hosts at 250mbit, bucket default ...", "2 hosts at 250mbit, bucket 70000 ...",
                      "2 hosts at 250mbit, bucket 70000 ...", "2 hosts at 250mbit, bucket default ..."]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["bandwidth"], r["burst"], r["burst_bytes"]) for r in rows] == [
        ("250mbit", "default", link_burst(250_000_000)), ("250mbit", 70000, 70000)]
    for r in rows:
        assert r["rounds"] == 2 and r["latency_s"] > 0
        for name in ("pair", "ring", "chain", "two_way"):
            # A share of the shaped rate: not the unshaped veth's ~40x it.
            assert len(r[f"{name}_rounds"]) == 2 and 0 < r[name] < 1.5, (name, r)
    assert doc["meta"]["compute"].startswith("none") and "| 250mbit | 70000 |" in proc.stdout
    assert (tmp_path / "links.png").stat().st_size > 0
    assert netns.our_namespaces() == []  # every cluster came down again


@pytest.mark.parametrize("args, message", [
    (["--local"], "--local: the links are what this benchmark measures"),
    (["--bursts", "1000"], "--bursts: '1000': a bucket is default or a whole number of bytes >= the MTU"),
    (["--bandwidths", "none"], "--bandwidths: none has no token bucket"),
    (["--hosts", "1"], "--hosts: must be between 2"),
])
def test_bad_input_is_one_line_before_any_cluster(args, message):
    proc = run(*args, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
