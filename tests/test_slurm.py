"""The batch scripts in slurm/, submitted with sbatch --wait to a real local SLURM of one node and of two."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from conftest import ROOT
from slurm_harness import local_slurm

pytestmark = pytest.mark.slurm

SCRIPTS = sorted(f for f in os.listdir(os.path.join(ROOT, "slurm")) if f.endswith(".sbatch"))
RANKS = 4  # every script's #SBATCH --ntasks
SBATCH_TIMEOUT = 60  # one job, queue to end; a job takes 4-16 s here
# The signal method raises inside the test, so the cluster fixture still tears down; the
# thread method of setup.cfg would end the process and leave the daemons to PR_SET_PDEATHSIG.
TEST_TIMEOUT = dict(timeout=SBATCH_TIMEOUT + 30, method="signal")


def _missing() -> str:
    if os.geteuid() != 0:
        return "needs root: the test starts munged, slurmctld and slurmd"
    if shutil.which("sbatch") is None or not os.path.exists("/usr/sbin/munged"):
        return "slurm-wlm and munge are not installed (apt-get install -y slurm-wlm munge)"
    return ""


needs_slurm = pytest.mark.skipif(bool(_missing()), reason=_missing() or "-")


@pytest.fixture(scope="module", params=[1, 2], ids=["one-node", "two-nodes"])
def cluster(request):
    """One cluster per layout for all the tests of this module (pytest groups the tests by layout)."""
    with local_slurm(nodes=request.param) as c:
        yield c


def submit(cluster, script: str, args: list[str], tmp_path, launcher: str | None = None):
    """`sbatch --wait slurm/SCRIPT ARGS` from the repository root; returns (return code, job output)."""
    out = tmp_path / "job.out"
    # Two nodes of 2 CPUs: 2 ranks each, the layout the script's README gives for several nodes.
    layout = ["--nodes=2", "--ntasks-per-node=2"] if len(cluster.nodes) == 2 else []
    cmd = ["sbatch", "--wait", f"--output={out}", "--time=2", *layout, f"slurm/{script}", *args]
    # Leave PYTHON to the script's default when that default is this interpreter, so it is tested too.
    default_python = os.path.join(ROOT, ".venv", "bin", "python")
    env = {"LAUNCHER": launcher,
           "PYTHON": None if os.path.abspath(sys.executable) == default_python else sys.executable}
    try:
        proc = cluster.run(cmd, timeout=SBATCH_TIMEOUT, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{' '.join(cmd)}` did not end in {SBATCH_TIMEOUT} s\n{_read(out)}\n{cluster.logs()}")
    text = _read(out)
    assert "Submitted batch job" in proc.stdout, f"sbatch refused the job: {proc.stderr}\n{cluster.logs()}"
    return proc.returncode, f"$ {' '.join(cmd)}\n{proc.stderr}{text}"


def _read(path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"(no job output: {path} missing)\n"


def bench_args(tmp_path, nodes):
    return ["--sizes", "4K,64K", "--iters", "2", "--json", str(tmp_path / "bench.json")]


def check_bench(text, tmp_path, nodes):
    lines = text.splitlines()
    assert any(re.match(r"op\s+impl\s+bytes\s+ranks\s", line) for line in lines), "no table header"
    rows = [line.split() for line in lines if re.match(r"[a-z_]+\s+(ring|ring-only|native)\s+\d+\s+\d+\s", line)]
    assert len(rows) == 4 * 2 * 3, f"expected 4 ops x 2 sizes x 3 impls table rows, got {len(rows)}"
    assert {r[3] for r in rows} == {str(RANKS)}
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["meta"]["ranks"] == RANKS
    assert {(r["op"], r["impl"]) for r in result["rows"]} == {(r[0], r[1]) for r in rows}
    assert len(result["rows"]) == len(rows)


def topology_args(tmp_path, nodes):
    return ["--expect-nodes", str(nodes), "--json", str(tmp_path / "topology.json")]


def check_topology(text, tmp_path, nodes):
    assert f": {RANKS} ranks on {nodes} node(s)" in text
    per_node = RANKS // nodes
    # SLURM places tasks in blocks: node i holds ranks i*per_node ... (i+1)*per_node - 1.
    expected = [list(range(i * per_node, (i + 1) * per_node)) for i in range(nodes)]
    for i, ranks in enumerate(expected):
        assert f"node {i}: ranks {ranks} on host" in text
    layout = json.loads((tmp_path / "topology.json").read_text())
    assert (layout["ranks"], layout["nodes"], layout["node_ranks"]) == (RANKS, nodes, expected)


def train_args(tmp_path, nodes):
    return ["--model", "mlp", "--data", "synthetic", "--synthetic-samples", "512", "--batch-size", "16",
            "--epochs", "1", "--json", str(tmp_path / "train.json")]


def check_train(text, tmp_path, nodes):
    assert "epoch 1: loss" in text
    result = json.loads((tmp_path / "train.json").read_text())
    assert result["ranks"] == RANKS and result["epochs"][0]["test_targets"] > 0


def bench_worker_args(tmp_path, nodes):
    return ["--model", "mlp", "--strategies", "allreduce,p3", "--batch-size", "8", "--batches", "2",
            "--iters", "1", "--warmup", "1", "--rounds", "1"]


def check_bench_worker(text, tmp_path, nodes):
    rows = [json.loads(line[4:]) for line in text.splitlines() if line.startswith("ROW ")]
    assert [r["strategy"] for r in rows] == ["allreduce", "p3"] and all(r["ranks"] == RANKS for r in rows)


def cache_warm_args(tmp_path, nodes):
    from datacache_helpers import make_png_dataset

    return ["--source", make_png_dataset(tmp_path / "png", n=50), "--cache-dir", str(tmp_path / "cache")]


def check_cache_warm(text, tmp_path, nodes):
    assert text.count("cold -> warm") == RANKS, text
    assert len(list((tmp_path / "cache").glob("*.h5"))) == RANKS


# Per script: quick job arguments, and the checks of a successful run's output.
JOBS = {
    "bench.sbatch": (bench_worker_args, check_bench_worker),
    "bench_collectives.sbatch": (bench_args, check_bench),
    "cache_warm.sbatch": (cache_warm_args, check_cache_warm),
    "topology.sbatch": (topology_args, check_topology),
    "train.sbatch": (train_args, check_train),
}


def test_every_script_is_tested():
    assert SCRIPTS == sorted(JOBS), f"add the new slurm/*.sbatch scripts to JOBS in {__file__}"


# On one node, the scripts whose output depends on the layout; the others' one-node runs add nothing the
# two-node runs and the one-node train run do not show, and each costs a 4-rank job's start (~13 s here).
ONE_NODE_TOO = ("topology.sbatch", "train.sbatch")


# The default launcher where the job's Python has no hydra mpiexec beside it (slurm/common.sh).
SRUN = "srun --mpi=pmi2 --kill-on-bad-exit=1"


@needs_slurm
@pytest.mark.timeout(**TEST_TIMEOUT)
@pytest.mark.parametrize("script", sorted(JOBS))
def test_script_runs_with_the_default_launcher(cluster, script, tmp_path):
    nodes = len(cluster.nodes)
    if nodes == 1 and script not in ONE_NODE_TOO:
        pytest.skip("on one node its output is the two-node run's, less the second node: run there")
    make_args, check = JOBS[script]
    rc, text = submit(cluster, script, make_args(tmp_path, nodes), tmp_path)
    assert rc == 0, f"job failed (rc {rc}):\n{text}"
    assert f"{RANKS} tasks on {nodes} node(s)" in text, text
    python = os.path.abspath(sys.executable)
    launcher = os.path.dirname(python) + "/mpiexec" if _is_hydra(python) else SRUN
    assert f"launcher: {launcher}\n" in text, text
    check(text, tmp_path, nodes)


def _is_hydra(python: str) -> bool:
    """Whether the mpiexec beside this interpreter is MPICH's hydra (the pip mpich wheel's)."""
    mpiexec = os.path.join(os.path.dirname(python), "mpiexec")
    if not os.access(mpiexec, os.X_OK):
        return False
    return "HYDRA" in subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout


@needs_slurm
@pytest.mark.timeout(**TEST_TIMEOUT)
def test_srun_launcher(cluster, tmp_path):
    """srun starts the ranks itself and serves their PMI through its pmi2 plugin, the way a site's MPI runs."""
    nodes = len(cluster.nodes)
    rc, text = submit(cluster, "topology.sbatch", topology_args(tmp_path, nodes), tmp_path, launcher=SRUN)
    # The wheel's MPICH fails under srun once many interfaces make its UCX address long (slurm/README.md).
    interfaces = [name for _, name in socket.if_nameindex()]
    assert rc == 0, f"job failed (rc {rc}), network interfaces here: {interfaces}\n{text}"
    assert f"launcher: {SRUN}\n" in text, text
    check_topology(text, tmp_path, nodes)


@needs_slurm
@pytest.mark.timeout(**TEST_TIMEOUT)
@pytest.mark.parametrize("script, args, message", [
    ("bench_collectives.sbatch", ["--ops", "nope"], "--ops: unknown 'nope'"),
    ("topology.sbatch", ["--expect-nodes", "3"], "error: expected 3 nodes"),
], ids=["invalid-argument", "wrong-node-count"])
def test_failing_job_fails_sbatch_wait(cluster, script, args, message, tmp_path):
    rc, text = submit(cluster, script, args, tmp_path)
    assert rc != 0, f"the job should have failed:\n{text}"
    assert message in text, text
