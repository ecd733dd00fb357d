"""Bad inputs to every job: one `error: --option: reason` line, exit 2, nothing written, no hang, no cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from datacache_helpers import make_png_dataset
from job_input_cases import CASES, PIPE, SCALING, TRAIN, WORKER

from conftest import ROOT
from mpicomm.launch import mpiexec


def tree(root) -> list[tuple[str, int]]:
    """Every path under root with its size (-1 for directories): what a job must leave unchanged."""
    found = []
    for top, dirs, files in os.walk(root):
        found += [(os.path.relpath(os.path.join(top, d), root), -1) for d in dirs]
        found += [(os.path.relpath(os.path.join(top, f), root), os.path.getsize(os.path.join(top, f))) for f in files]
    return sorted(found)


def run_bounded(cmd, timeout):
    """(returncode, stdout, stderr); returncode None if it hung, its whole process group then killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


@pytest.mark.parametrize("job,args,option,flags", [pytest.param(job, args, option, flags, id=name)
                                                   for name, job, args, option, *flags in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, job, args, option, flags):
    inputs, out = tmp_path / "in", tmp_path / "out"
    (out / "existing").mkdir(parents=True)
    inputs.mkdir()
    (inputs / "file.txt").write_text("not a directory\n")
    places = dict(out=str(out), dir=str(out / "existing"), file=str(inputs / "file.txt"),
                  missing=str(inputs / "missing"), png=str(inputs / "png"))
    if any("{png}" in a for a in args):
        make_png_dataset(inputs / "png", n=40, size=28)
    before = tree(tmp_path)
    cmd = [sys.executable, "-m", job, *(a.format(**places) for a in args)]
    if "mpiexec" in flags:
        cmd = [mpiexec(), "-n", "2", *cmd]
    code, stdout, stderr = run_bounded(cmd, timeout=90)
    lines = [line for line in stderr.splitlines() if line.strip()]
    problems = []
    if code is None:
        problems.append("hung (killed after 90 s)")
    elif code != 2:
        problems.append(f"exit {code}")
    if "Traceback" in stderr:
        problems.append("traceback")
    if len(lines) != 1:
        problems.append(f"{len(lines)} stderr lines")
    elif not (lines[0].startswith("error: ") and option.format(**places) in lines[0]):
        problems.append(f"stderr line does not start with 'error: ' and name {option}")
    changed = sorted(set(tree(tmp_path)) ^ set(before))
    if changed:
        problems.append(f"wrote {[p for p, _ in changed][:4]}")
    assert not problems, f"{'; '.join(problems)}\nstderr: {stderr[-1500:]}\nstdout: {stdout[-500:]}"


def test_cluster_run_local_starts_commands_found_as_mpiexec_finds_them():
    """A bare word through PATH, an absolute path as it is: both pass the check and run on every rank."""
    for cmd in (["true"], [sys.executable, "-c", "print('ran')"]):
        proc = subprocess.run([sys.executable, "-m", "jobs.cluster", "run", "--local", "-n", "2", "--", *cmd],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == 0 and proc.stdout.count("ran") == (2 if len(cmd) > 1 else 0), proc.stderr


def test_the_jobs_names_are_runtimes():
    """jobs.common.choices lets the jobs check names before runtime (and MPI) is imported: it must not drift."""
    from jobs.common import choices
    from runtime import SPARSE_STRATEGIES, STRATEGIES
    from runtime.options import AUTO, HYBCOMM_DENSE, HYBCOMM_FORCE, ONLINE
    from runtime.workloads.models import FIXED_CLASSES, MODELS

    assert choices.MODELS == tuple(MODELS) and choices.FIXED_CLASSES == FIXED_CLASSES
    assert choices.EXACT_STRATEGIES == tuple(STRATEGIES) and choices.SPARSE_STRATEGIES == tuple(SPARSE_STRATEGIES)
    assert (choices.HYBCOMM_DENSE, choices.HYBCOMM_FORCE) == (HYBCOMM_DENSE, HYBCOMM_FORCE)
    assert choices.P3_CREDIT_WORDS == (AUTO, ONLINE)


def test_train_hands_hybcomm_its_options():
    """--hybcomm-dense, --hybcomm-force, --link-bandwidth (and the dense path's --slice-size, --credit) reach
    HybCommOptions."""
    from jobs import train

    opts = train.strategy_options(train.parse_args([*TRAIN, "--strategy", "hybcomm", "--hybcomm-dense", "p3",
                                                    "--hybcomm-force", "sfb", "--link-bandwidth", "2.5gbit",
                                                    "--slice-size", "1000", "--credit", "3"]))
    assert (opts.name, opts.dense, opts.force, opts.bandwidth, opts.slice_size, opts.credit) == \
        ("hybcomm", "p3", "sfb", 2_500_000_000, 1000, 3)
    args = train.parse_args([*TRAIN, "--strategy", "hybcomm"])
    opts = train.strategy_options(args)
    assert (opts.dense, opts.force, opts.bandwidth) == ("wfbp", "auto", None)  # None: the cost model's default
    assert (args.hybcomm_dense, args.hybcomm_force) == ("wfbp", "auto")  # what the JSON's args say
    assert train.parse_args([*TRAIN, "--model", "vgg19-22k"]).model == "vgg19-22k"  # synthetic data: fine


def test_bench_worker_takes_hybcomm_and_its_forced_variants():
    from jobs.bench import contenders
    from jobs.bench import strategies_worker as bench_worker

    args = bench_worker.parse_args([*WORKER, "--strategies", "hybcomm,hybcomm-sfb,hybcomm-ps+pto,ddp",
                                    "--bandwidth", "1gbit"])
    assert args.strategies == ["hybcomm", "hybcomm-sfb", "hybcomm-ps+pto", "ddp"]
    opts = contenders.hybcomm_options(args, "ps")
    assert (opts.name, opts.force, opts.bandwidth) == ("hybcomm", "ps", 1_000_000_000)
    for label in ("unshaped", "local-unshaped"):  # no link rate to tell the cost model
        args.bandwidth = label
        assert contenders.hybcomm_options(args, "auto").bandwidth is None


def test_bench_worker_takes_p3s_variants():
    """p3-flat, p3-messages, p3-unpaced and p3-yield: p3 with its settings changed, the others as by default,
    slice and credit as given."""
    from jobs.bench import contenders
    from jobs.bench import strategies_worker as bench_worker

    args = bench_worker.parse_args([*WORKER, "--strategies", "p3,p3-flat,p3-messages,p3-unpaced,p3-yield",
                                    "--bandwidth", "1gbit"])
    opts = [contenders.strategy_options(s, args) for s in args.strategies]
    assert [(o.name, o.node_aggregation, o.node_window, o.node_pacing, o.yield_link) for o in opts] == [
        ("p3", True, True, True, False), ("p3", False, True, True, False), ("p3", True, False, True, False),
        ("p3", True, False, False, False), ("p3", True, True, True, True)]
    args = bench_worker.parse_args([*WORKER, "--strategies", "p3,p3@auto/online,p3@4096/2", "--credit", "online"])
    assert [contenders.p3_settings(s, args) for s in args.strategies] == \
        [("auto", "online"), ("auto", "online"), (4096, 2)]  # credit "online": its trials (runtime.p3.online_credit)


def test_bench_worker_takes_wfbps_windows():
    """wfbp/N: at most N buckets under way; wfbp/all: no limit; plain wfbp: the default (one)."""
    from jobs.bench import contenders
    from jobs.bench import strategies_worker as bench_worker

    args = bench_worker.parse_args([*WORKER, "--strategies", "wfbp,wfbp/2,wfbp/all", "--bandwidth", "1gbit"])
    opts = [contenders.strategy_options(s, args) for s in args.strategies]
    assert opts[0] == "wfbp" and [(o.name, o.in_flight) for o in opts[1:]] == [("wfbp", 2), ("wfbp", None)]


def test_bench_scaling_takes_a_bandwidth_and_rank_counts():
    from jobs.bench import scaling as bench_scaling

    args = bench_scaling.parse_args(["--models", "vgg19-22k", "--ranks", "1,2,4,8", "--bandwidth", "10gbit",
                                     "--strategies", "wfbp,p3,hybcomm,ddp"])
    assert (args.ranks, args.bandwidths, args.local) == ([1, 2, 4, 8], ["10gbit"], False)
    from jobs.bench.strategies import run_settings
    assert run_settings(args, "vgg19-22k")["batch_size"] == 8  # real compute: the default batch
    args = bench_scaling.parse_args([*SCALING, "--ranks", "1,2,6", "--ranks-per-host", "2"])
    assert args.ranks == [1, 2, 6]  # one rank alone needs no full host


@pytest.mark.parametrize("job,args,message", [
    ("train", [*TRAIN, "--strategy", "hybcomm", "--link-bandwidth", "fast"], "--link-bandwidth: cannot parse"),
    ("bench.scaling", ["--models", "mlp", "--ranks", "1,2,128"], "--ranks: 128 ranks need more than 64 hosts"),
    ("bench.strategies", ["--congestion-control", "Cubic!"], "--congestion-control: congestion control must be a"),
    # Below the MTU the link got max(1500, burst) while `up` reported the bucket asked (bench links refuses it too);
    # refused before any namespace is made, so no root is needed to check it.
    ("cluster", ["up", "--burst", "10"], "--burst: 10: a bucket is a whole number of bytes >= the MTU (1500)"),
], ids=["train-link-bandwidth-unparseable", "scaling-ranks-beyond-the-hosts", "bench-congestion-control-not-a-name",
        "cluster-up-burst-below-the-mtu"])
def test_checks_that_need_mpicomm(capsys, job, args, message):
    """In this process, which has imported mpicomm (torch) already: a job pays that only when the option is given."""
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"jobs.{job}").parse_args(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and message in err and len(err.splitlines()) == 1
