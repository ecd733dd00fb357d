"""The harness itself: a failing rank aborts the job, emulated hosts group ranks, jobs import cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT
from mpicomm.launch import emulated_hosts, mpiexec


def run_mpi(tmp_path, n, code, extra=(), timeout=60, env=None):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(code))
    cmd = [mpiexec(), *extra, "-n", str(n), sys.executable, "-m", "mpi4py", str(script)]
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpiexec hung for {timeout}s: {exc.stdout!r} {exc.stderr!r}")


def test_one_rank_failing_aborts_the_job(tmp_path):
    """Rank 1 raises while the others wait in a barrier: the job must end, not hang."""
    proc = run_mpi(tmp_path, 4, """
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            raise RuntimeError("rank 1 gives up")
        MPI.COMM_WORLD.Barrier()
    """, timeout=30)
    assert proc.returncode != 0
    assert "rank 1 gives up" in proc.stderr


def test_emulated_two_nodes_of_two(tmp_path):
    proc = run_mpi(tmp_path, 4, """
        from mpicomm import Topology
        with Topology() as t:
            open(f"out.{t.rank}", "w").write(f"{t.num_nodes} {t.nodes} {t.cross.Get_size()}")
    """, extra=emulated_hosts("n1:2,n2:2"))
    assert proc.returncode == 0, proc.stderr
    assert [(tmp_path / f"out.{r}").read_text() for r in range(4)] == ["2 [[0, 1], [2, 3]] 2"] * 4


def test_uneven_hosts_refused_on_every_rank(tmp_path):
    proc = run_mpi(tmp_path, 4, """
        from mpi4py import MPI
        from mpicomm import Topology, TopologyError
        try:
            Topology()
        except TopologyError as exc:
            open(f"out.{MPI.COMM_WORLD.Get_rank()}", "w").write(str(exc))
    """, extra=emulated_hosts("n1:3,n2:1"))
    assert proc.returncode == 0, proc.stderr
    for r in range(4):
        assert "nodes hold different numbers of ranks" in (tmp_path / f"out.{r}").read_text()


def test_jobs_import_without_starting_mpi():
    """Every job and helper, in every room of jobs/: importing it (and so checking its command line, which comes
    first) starts neither MPI nor torch."""
    code = ("import importlib, pkgutil, sys, jobs\n"
            "names = [m.name for m in pkgutil.walk_packages(jobs.__path__, 'jobs.')]\n"
            "assert 'jobs.bench.pipeline_worker' in names and 'jobs.common.inputs' in names, names\n"
            "for name in names: importlib.import_module(name)\n"
            "assert 'mpi4py.MPI' not in sys.modules and 'torch' not in sys.modules, 'MPI or torch started at import'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_the_mpi_layer_and_its_torch_free_tools_run_without_importing_torch(tmp_path):
    """torch's import costs each process ~1 CPU-s: `mpicomm` (numpy buffers), `mpitrain topology`, the emulated
    cluster's link tools, `bench collectives` and `mpitrain cache` run whole without it; a tensor still goes through
    (test_buffers), and the cache's training batches are tensors (test_datacache_cache)."""
    from datacache_helpers import make_png_dataset

    source, cache = make_png_dataset(tmp_path / "png", n=20), str(tmp_path / "cache")
    code = textwrap.dedent(f"""
        import runpy, sys
        import mpicomm, mpicomm.collectives, mpicomm.emulation.probe, mpicomm.emulation.pingpong, jobs.cluster
        for argv in (["jobs.topology", "--json", {str(tmp_path / "t.json")!r}],
                     ["jobs.bench.collectives", "--sizes", "4K", "--iters", "1", "--rounds", "1",
                      "--json", {str(tmp_path / "c.json")!r}],
                     ["jobs.cache", "warm", "--source", {source!r}, "--cache-dir", {cache!r}],
                     ["jobs.cache", "verify", "--cache-dir", {cache!r}]):
            sys.argv = argv
            try:
                runpy.run_module(argv[0], run_name="__main__")
            except SystemExit as exc:
                assert not exc.code, (argv, exc.code)
        import datacache
        assert set(datacache.__all__) <= set(dir(datacache)), "dir() misses the lazy names"
        assert "torch" not in sys.modules, "torch was imported"
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t.json").exists() and (tmp_path / "c.json").exists()
    assert "cold -> warm" in proc.stdout and len(list((tmp_path / "cache").glob("*.h5"))) == 1, proc.stdout


def test_h5py_is_imported_only_by_a_job_that_opens_a_shard():
    """Every rank of `mpitrain train` imports datacache (the corpus's errors); h5py (~0.1 s) waits for a shard."""
    code = "import sys, datacache, runtime, jobs.train\nassert 'h5py' not in sys.modules, 'h5py was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_bench_collectives_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "res" / "c.json"
    cross = tmp_path / "cross.json"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "jobs.bench.collectives", "--sizes", "4K,64K",
           "--iters", "2", "--rounds", "2", "--latency-bytes", "16K", "--json", str(out), "--crossover", str(cross)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "busbw_GB/s" in proc.stdout and "ring / native busbw" in proc.stdout and "crossover" in proc.stdout
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert len(rows) == 4 * 2 * 3  # ops x sizes x impls (ring, ring-only, native)
    # The ring impl takes MPI's collective below --latency-bytes only.
    assert {(r["bytes"], r["path"]) for r in rows if r["impl"] == "ring"} == {(4096, "latency"), (65536, "ring")}
    assert all(len(r["round_times_s"]) == 2 for r in rows)
    # Ring reads the crossover file back through the environment.
    table = json.loads(cross.read_text())["latency_bytes"]
    assert set(table) == {"allreduce", "reduce_scatter", "allgather", "broadcast"}
    check = ("from mpicomm import Ring; from mpi4py import MPI; "
             "print(sorted(Ring(MPI.COMM_SELF).latency_bytes.items()))")
    env = dict(os.environ, MPITRAIN_RING_LATENCY_BYTES=str(cross))
    got = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert got.stdout.strip() == str(sorted(table.items())), got.stderr
    for r in rows:
        assert {"op", "impl", "bytes", "ranks", "time_s", "algbw_gbps", "busbw_gbps"} <= set(r)
        assert r["ranks"] == 2 and r["time_s"] > 0
        factor = {"allreduce": 1.0, "reduce_scatter": 0.5, "allgather": 0.5, "broadcast": 1.0}[r["op"]]
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_collectives_chooses_the_allreduce_algorithm(tmp_path):
    """The topology-aware impls on 2 emulated nodes x 2; --choose writes the table auto then follows."""
    out, table = tmp_path / "c.json", tmp_path / "allreduce.json"
    cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "jobs.bench.collectives", "--ops", "allreduce",
           "--sizes", "4K,1M", "--iters", "2", "--rounds", "1", "--ranks-per-node", "2",
           "--impls", "ring-only,doubling,hierarchical,auto", "--json", str(out), "--choose", str(table)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 node(s) x 2" in proc.stdout and "the fastest algorithm per size" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {(r["impl"], r["bytes"]) for r in rows} == {(i, b) for i in ("ring-only", "doubling", "hierarchical", "auto")
                                                         for b in (4096, 1 << 20)}
    assert {r["path"] for r in rows if r["impl"] == "hierarchical"} == {"hierarchical"}
    assert {r["across"] for r in rows if r["impl"] == "hierarchical"} <= {"ring", "doubling", "rabenseifner"}
    for r in (r for r in rows if r["impl"] == "auto"):  # judged against the fastest algorithm's row, paired by round
        judged = r["vs_fastest"]
        assert judged["auto"]["within"] in ("yes", "no", "undecided") and judged["auto_took"] == r["path"]
        assert judged["choice"]["within"] in ("yes", "no", "undecided")
    assert "paired by round" in proc.stdout and "auto took " in proc.stdout
    assert json.loads(out.read_text())["meta"]["auto"].startswith("allreduce auto, cost model alpha=")
    doc = json.loads(table.read_text())
    assert doc["layout"] == {"ranks": 4, "nodes": 2, "per_node": 2} and doc["allreduce"][-1][0] is None
    fastest = {}
    for r in rows:
        if r["impl"] != "auto" and (r["bytes"] not in fastest or r["time_s"] < fastest[r["bytes"]][0]):
            fastest[r["bytes"]] = (r["time_s"], r["impl"].replace("ring-only", "ring"))
    check = ("from mpicomm.algorithms import Chooser, Layout; c = Chooser(Layout(4, 2, 2)); "
             "print(c.table_applies, c.choose(4096), c.choose(1 << 20))")
    env = dict(os.environ, MPITRAIN_ALLREDUCE_TABLE=str(table))
    got = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert got.stdout.split() == ["True", fastest[4096][1], fastest[1 << 20][1]], got.stderr


def test_bench_collectives_rejects_bad_arguments():
    for args, msg in ((["--sizes", "4Q"], "not a size"), (["--ops", "alltoall"], "--ops: unknown 'alltoall'"),
                      (["--iters", "-1"], ">= 0")):
        proc = subprocess.run([sys.executable, "-m", "jobs.bench.collectives", *args], capture_output=True,
                              text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == 2 and msg in proc.stderr, (args, proc.stderr)


RUN_MAIN_JOB = """
    import sys, time
    from mpi4py import MPI
    from mpicomm.launch import run_main

    def main():
        comm = MPI.COMM_WORLD
        comm.Barrier()
        if comm.Get_rank() == 2:
            time.sleep(0.5)  # the others are inside the collective by now
            raise RuntimeError("rank 2 fails mid-run")
        comm.Barrier()  # where the other ranks would wait forever
        return 0

    run_main(main)
"""


def test_run_main_aborts_every_rank_when_one_raises(tmp_path):
    """Plain `python prog.py`, no `-m mpi4py`: run_main alone turns one rank's exception into an abort."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(RUN_MAIN_JOB))
    cmd = ["timeout", "-k", "5", "30", mpiexec(), "-n", "4", sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), cwd=tmp_path)
    assert proc.returncode not in (0, 124, 137), (proc.returncode, proc.stderr[-2000:])
    assert "[rank 2] Traceback (most recent call last):" in proc.stderr
    assert "[rank 2] RuntimeError: rank 2 fails mid-run" in proc.stderr


def test_run_main_lets_system_exit_through(tmp_path):
    """A status every rank chose is the job's exit status; no abort, no traceback."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import sys
        from mpi4py import MPI
        from mpicomm.launch import run_main

        def main():
            MPI.COMM_WORLD.Barrier()
            sys.exit(3)

        run_main(main)
    """))
    cmd = ["timeout", "-k", "5", "30", mpiexec(), "-n", "2", sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Abort" not in proc.stderr
