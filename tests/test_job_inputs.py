"""Bad inputs to every job: one `error: --option: reason` line, exit 2, nothing written, no hang, no cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from datacache_helpers import make_png_dataset

from conftest import ROOT
from mpicomm.launch import mpiexec

# Small settings, so that a run the job wrongly accepts still ends soon (and the case fails, not hangs).
TRAIN = ["--model", "mlp", "--data", "synthetic", "--synthetic-samples", "512", "--batch-size", "32",
         "--no-progress", "--epochs", "1"]
CACHED = ["--model", "mlp", "--no-progress", "--epochs", "1", "--max-steps", "2", "--batch-size", "8"]
WORKER = ["--model", "mlp", "--batch-size", "8", "--batches", "2", "--iters", "1", "--warmup", "1",
          "--strategies", "allreduce"]
LOCAL = ["--local", "--hosts", "2", "--models", "mlp", "--batch-size", "8", "--batches", "2", "--iters", "1",
         "--warmup", "1", "--strategies", "allreduce"]
COLL = ["--sizes", "4K", "--iters", "1", "--ops", "allreduce"]
MSTOPK = ["--sizes", "1000", "--densities", "0.1", "--repeats", "1"]
PTO = ["--model", "mlp", "--repeats", "1", "--warmup", "0"]
SOAK = ["--steps", "20", "--every", "10", "--settle", "0"]
OVERHEAD = ["--models", "mlp", "--steps", "1", "--warmup", "0", "--rounds", "1"]
SCALING = ["--local", "--models", "mlp", "--strategies", "allreduce", "--batch-size", "8", "--batches", "2",
           "--iters", "1", "--warmup", "1"]
PIPE = ["--local", "--hosts", "2", "--models", "mlp", "--batch-size", "8", "--microbatches", "2", "--rounds", "1",
        "--iters", "1", "--warmup", "0"]

# (id, job, arguments, the option the error must name, marks). Placeholders: {out} an empty output
# directory, {dir} an existing empty directory inside it, {file} an existing file, {missing} a path that
# does not exist, {png} a small labels.csv image dataset. "mpiexec": run as `mpiexec -n 2`.
# "cluster": without the check, the job would bring up an emulated cluster (root) first.
CASES = [
    ("train-max-steps-negative", "jobs.train", [*TRAIN, "--max-steps", "-5", "--json", "{out}/m.json"], "--max-steps"),
    ("train-slice-size-negative", "jobs.train", [*TRAIN, "--strategy", "p3", "--slice-size", "-1"], "--slice-size"),
    ("train-slice-size-zero", "jobs.train", [*TRAIN, "--slice-size", "0", "--json", "{out}/m.json"], "--slice-size"),
    ("train-json-is-a-directory", "jobs.train", [*TRAIN, "--max-steps", "2", "--json", "{dir}"], "--json"),
    ("train-json-under-a-file", "jobs.train", [*TRAIN, "--max-steps", "2", "--json", "{file}/m.json"], "--json"),
    ("train-timeline-is-a-directory", "jobs.train", [*TRAIN, "--max-steps", "2", "--timeline", "{dir}"],
     "--timeline"),
    ("train-timeline-under-a-file", "jobs.train", [*TRAIN, "--max-steps", "2", "--timeline", "{file}/t.json"],
     "--timeline"),
    ("train-checkpoint-under-a-file", "jobs.train", [*TRAIN, "--max-steps", "2", "--checkpoint", "{file}/c.pt"],
     "--checkpoint"),
    ("train-checkpoint-is-a-directory", "jobs.train", [*TRAIN, "--max-steps", "2", "--checkpoint", "{dir}"],
     "--checkpoint"),
    ("train-mpiexec-3-epochs-checkpoint-under-a-file", "jobs.train",
     [*TRAIN, "--epochs", "3", "--max-steps", "2", "--checkpoint", "{file}/c.pt"], "--checkpoint", "mpiexec"),
    ("train-mpiexec-json-is-a-directory", "jobs.train", [*TRAIN, "--max-steps", "2", "--json", "{dir}"], "--json",
     "mpiexec"),
    ("train-strategy-unknown", "jobs.train", [*TRAIN, "--strategy", "nope"], "--strategy"),
    ("train-density-above-1", "jobs.train", [*TRAIN, "--strategy", "topk", "--density", "1.5"], "--density"),
    ("train-epochs-zero", "jobs.train", [*TRAIN, "--epochs", "0"], "--epochs"),
    ("train-lr-negative", "jobs.train", [*TRAIN, "--lr", "-0.1"], "--lr"),
    ("train-momentum-negative", "jobs.train", [*TRAIN, "--momentum", "-1"], "--momentum"),
    # `value < minimum` is False for NaN: at_least let NaN through, and inf too where a finite value is needed.
    ("train-lr-nan", "jobs.train", [*TRAIN, "--lr", "nan"], "--lr"),
    ("train-momentum-inf", "jobs.train", [*TRAIN, "--momentum", "inf"], "--momentum"),
    ("train-seed-negative", "jobs.train", [*TRAIN, "--seed", "-1"], "--seed"),
    ("train-model-unknown", "jobs.train", [*TRAIN, "--model", "alexnet"], "--model"),
    ("train-22k-classes-on-fashion-mnist", "jobs.train", [*TRAIN, "--model", "vgg19-22k", "--data", "fashion-mnist"],
     "--data"),
    ("train-hybcomm-force-with-wfbp", "jobs.train", [*TRAIN, "--strategy", "wfbp", "--hybcomm-force", "sfb"],
     "--hybcomm-force"),
    ("train-hybcomm-dense-with-default-strategy", "jobs.train", [*TRAIN, "--hybcomm-dense", "wfbp"],
     "--hybcomm-dense"),
    ("train-link-bandwidth-with-allreduce", "jobs.train", [*TRAIN, "--strategy", "allreduce", "--link-bandwidth",
                                                           "1gbit"], "--link-bandwidth"),
    ("train-hybcomm-dense-unknown", "jobs.train", [*TRAIN, "--strategy", "hybcomm", "--hybcomm-dense", "allreduce"],
     "--hybcomm-dense"),
    ("train-hybcomm-force-unknown", "jobs.train", [*TRAIN, "--strategy", "hybcomm", "--hybcomm-force", "topk"],
     "--hybcomm-force"),
    ("train-data-dir-missing", "jobs.train", [*CACHED, "--cache-dir", "{out}/cache", "--data-dir", "{missing}"],
     "--data-dir"),
    ("train-cache-dir-is-a-file", "jobs.train", [*CACHED, "--cache-dir", "{file}", "--data-dir", "{png}"],
     "--cache-dir"),
    ("train-cache-memory-negative", "jobs.train",
     [*CACHED, "--cache-dir", "{out}/cache", "--data-dir", "{png}", "--cache-memory-mb", "-1"], "--cache-memory-mb"),
    ("worker-model-unknown", "jobs.bench.strategies_worker", [*WORKER, "--model", "alexnet"], "--model"),
    ("worker-density-zero", "jobs.bench.strategies_worker", [*WORKER, "--strategies", "topk", "--density", "0"], "--density"),
    ("worker-slice-size-negative", "jobs.bench.strategies_worker", [*WORKER, "--strategies", "p3", "--slice-size", "-4"],
     "--slice-size"),
    ("worker-credit-word", "jobs.bench.strategies_worker", [*WORKER, "--strategies", "p3", "--credit", "many"], "--credit"),
    ("worker-p3-variant", "jobs.bench.strategies_worker", [*WORKER, "--strategies", "p3@1k/2"], "--strategies"),
    ("worker-p3-slice-online", "jobs.bench.strategies_worker", [*WORKER, "--strategies", "p3@online/2"],
     "--strategies"),
    ("worker-algorithm-variant", "jobs.bench.strategies_worker", [*WORKER, "--strategies", "wfbp@tree"], "--strategies"),
    ("worker-wfbp-window-zero", "jobs.bench.strategies_worker", [*WORKER, "--strategies", "wfbp/0"], "--strategies"),
    ("worker-wfbp-window-word", "jobs.bench.strategies_worker", [*WORKER, "--strategies", "wfbp/many"], "--strategies"),
    ("train-credit-zero", "jobs.train", [*TRAIN, "--credit", "0"], "--credit"),
    ("worker-iters-zero", "jobs.bench.strategies_worker", [*WORKER, "--iters", "0"], "--iters"),
    ("worker-threads-zero", "jobs.bench.strategies_worker", [*WORKER, "--threads", "0"], "--threads"),
    ("worker-hybcomm-variant-unknown", "jobs.bench.strategies_worker", [*WORKER, "--strategies", "wfbp,hybcomm-p3"],
     "--strategies"),
    ("bench-local-strategy-unknown", "jobs.bench", [*LOCAL, "--strategies", "p4", "--json", "{out}/b.json"],
     "--strategies"),
    ("bench-local-model-unknown", "jobs.bench", [*LOCAL, "--models", "alexnet"], "--models"),
    ("bench-local-density-above-1", "jobs.bench", [*LOCAL, "--strategies", "topk", "--density", "2"], "--density"),
    ("bench-local-with-bandwidths", "jobs.bench", [*LOCAL, "--bandwidths", "1gbit", "--json", "{out}/b.json"],
     "--bandwidths"),
    ("bench-local-with-congestion-control", "jobs.bench", [*LOCAL, "--congestion-control", "cubic"],
     "--congestion-control"),
    ("bench-local-json-under-a-file", "jobs.bench", [*LOCAL, "--json", "{file}/b.json"], "--json"),
    ("bench-local-ranks-per-host-zero", "jobs.bench", [*LOCAL, "--ranks-per-host", "0"], "--ranks-per-host"),
    ("bench-local-rounds-zero", "jobs.bench", [*LOCAL, "--rounds", "0"], "--rounds"),
    ("bench-bandwidth-unparseable", "jobs.bench", ["--models", "mlp", "--bandwidths", "junk"], "--bandwidths"),
    ("bench-hosts-zero", "jobs.bench", ["--models", "mlp", "--hosts", "0"], "--hosts"),
    ("bench-strategy-unknown", "jobs.bench", ["--models", "mlp", "--bandwidths", "1gbit", "--strategies", "p4"],
     "--strategies", "cluster"),
    ("bench-slice-size-negative", "jobs.bench", ["--models", "mlp", "--bandwidths", "1gbit", "--slice-size", "-1"],
     "--slice-size", "cluster"),
    ("scaling-local-ranks-not-increasing", "jobs.bench.scaling", [*SCALING, "--ranks", "1,4,2"], "--ranks"),
    ("scaling-local-ranks-empty", "jobs.bench.scaling", [*SCALING, "--ranks", ","], "--ranks"),
    ("scaling-local-ranks-zero", "jobs.bench.scaling", [*SCALING, "--ranks", "0,1"], "--ranks"),
    ("scaling-local-ranks-not-filling-hosts", "jobs.bench.scaling", [*SCALING, "--ranks", "1,2,3",
                                                                     "--ranks-per-host", "2"], "--ranks"),
    ("scaling-local-with-bandwidth", "jobs.bench.scaling", [*SCALING, "--ranks", "1,2", "--bandwidth", "1gbit"],
     "--bandwidths"),
    ("scaling-local-strategy-unknown", "jobs.bench.scaling", [*SCALING, "--strategies", "hybcomm-auto"],
     "--strategies"),
    ("collectives-json-is-a-directory", "jobs.bench.collectives", [*COLL, "--json", "{dir}"], "--json"),
    ("collectives-plot-under-a-file", "jobs.bench.collectives", [*COLL, "--plot", "{file}/p.png"], "--plot"),
    ("collectives-link-gbps-negative", "jobs.bench.collectives", [*COLL, "--link-gbps", "-1"], "--link-gbps"),
    ("collectives-chunk-bytes-zero", "jobs.bench.collectives", [*COLL, "--chunk-bytes", "0"], "--chunk-bytes"),
    ("collectives-choose-without-doubling", "jobs.bench.collectives", [*COLL, "--choose", "{out}/c.json"], "--choose"),
    ("collectives-ranks-per-node-zero", "jobs.bench.collectives", [*COLL, "--ranks-per-node", "0"], "--ranks-per-node"),
    ("bench-cache-source-missing", "jobs.bench.cache", ["--source", "{missing}", "--cache-dir", "{out}/c"],
     "--source"),
    ("bench-cache-memory-negative", "jobs.bench.cache",
     ["--source", "{png}", "--cache-dir", "{out}/c", "--epochs", "2", "--memory-mb", "-1"], "--memory-mb"),
    ("bench-cache-cache-dir-is-a-file", "jobs.bench.cache", ["--source", "{png}", "--cache-dir", "{file}"],
     "--cache-dir"),
    ("bench-cache-workers-negative", "jobs.bench.cache",
     ["--source", "{png}", "--cache-dir", "{out}/c", "--workers", "-1"], "--workers"),
    ("mstopk-json-is-a-directory", "jobs.bench.mstopk", [*MSTOPK, "--json", "{dir}"], "--json"),
    ("mstopk-iters-zero", "jobs.bench.mstopk", [*MSTOPK, "--iters", "0"], "--iters"),
    ("pto-model-unknown", "jobs.bench.pto", [*PTO, "--model", "alexnet"], "--model"),
    ("pto-plot-under-a-file", "jobs.bench.pto", [*PTO, "--plot", "{file}/p.png"], "--plot"),
    ("soak-steps-zero", "jobs.soak", [*SOAK, "--steps", "0"], "--steps"),
    ("soak-settle-beyond-steps", "jobs.soak", [*SOAK, "--settle", "20"], "--settle"),
    # The verdict compares the baseline with a later sample: none at all was a StopIteration on every rank, one
    # a growth of 0 and "ok".
    ("soak-mpiexec-no-sample", "jobs.soak", ["--steps", "5", "--every", "10", "--settle", "0"], "--every", "mpiexec"),
    ("soak-one-sample-after-settle", "jobs.soak", ["--steps", "20", "--every", "30", "--settle", "5"], "--every"),
    ("soak-strategy-unknown", "jobs.soak", [*SOAK, "--strategy", "nope"], "--strategy"),
    ("soak-mpiexec-json-is-a-directory", "jobs.soak", [*SOAK, "--json", "{dir}"], "--json", "mpiexec"),
    ("overhead-model-unknown", "jobs.bench.overhead", [*OVERHEAD, "--models", "mlp,alexnet"], "--models"),
    ("overhead-strategy-unknown", "jobs.bench.overhead", [*OVERHEAD, "--strategies", "ddp"], "--strategies"),
    ("overhead-rounds-zero", "jobs.bench.overhead", [*OVERHEAD, "--rounds", "0"], "--rounds"),
    # --steps 0 times no step: the plot asked for was dropped without a word.
    ("overhead-steps-zero-with-plot", "jobs.bench.overhead", [*OVERHEAD, "--steps", "0", "--plot", "{out}/p.png"],
     "--plot"),
    ("overhead-mpiexec-plot-under-a-file", "jobs.bench.overhead", [*OVERHEAD, "--plot", "{file}/p.png"], "--plot",
     "mpiexec"),
    ("pipeline-defaults-model-too-slow", "jobs.bench.pipeline_defaults", ["--models", "mlp,vgg19"], "--models"),
    ("pipeline-defaults-mode-unknown", "jobs.bench.pipeline_defaults", ["--modes", "flush,gpipe"], "--modes"),
    ("pipeline-defaults-baseline-missing", "jobs.bench.pipeline_defaults", ["--baseline", "{missing}"],
     "--baseline"),
    ("convergence-strategy-unknown", "jobs.bench.convergence",
     ["--configs", "nope", "--seeds", "0", "--epochs", "1", "--max-steps", "1"], "--configs"),
    ("convergence-density-not-a-number", "jobs.bench.convergence", ["--configs", "topk:abc"], "--configs"),
    ("convergence-seeds-not-numbers", "jobs.bench.convergence", ["--seeds", "a"], "--seeds"),
    ("convergence-ranks-per-node-not-dividing", "jobs.bench.convergence",
     ["--configs", "allreduce", "--seeds", "0", "--epochs", "1", "--max-steps", "1", "--ranks", "4",
      "--ranks-per-node", "3"], "--ranks-per-node"),
    ("cache-warm-seed-negative", "jobs.cache",
     ["warm", "--source", "{png}", "--cache-dir", "{out}/c", "--seed", "-1"], "--seed"),
    ("cache-warm-source-missing", "jobs.cache", ["warm", "--source", "{missing}", "--cache-dir", "{out}/c"],
     "--source"),
    ("cache-warm-cache-dir-is-a-file", "jobs.cache", ["warm", "--source", "{png}", "--cache-dir", "{file}"],
     "--cache-dir"),
    ("cache-export-out-is-a-file", "jobs.cache", ["export", "--out", "{file}"], "--out"),
    ("cache-info-cache-dir-missing", "jobs.cache", ["info", "--cache-dir", "{missing}"], "--cache-dir"),
    ("cluster-up-hosts-zero", "jobs.cluster", ["up", "--hosts", "0"], "--hosts"),
    ("cluster-up-bandwidth-unparseable", "jobs.cluster", ["up", "--bandwidth", "junk"], "--bandwidth"),
    ("cluster-run-local-np-zero", "jobs.cluster", ["run", "--local", "-n", "0", "--", "true"], "--np"),
    # The program is resolved before mpiexec starts (it would print execvp errors per rank and exit 255).
    ("cluster-run-local-no-such-file", "jobs.cluster", ["run", "--local", "-n", "2", "--", "{missing}/cmd"],
     "run: {missing}/cmd: no such command"),
    ("cluster-run-local-not-on-path", "jobs.cluster", ["run", "--local", "-n", "2", "--", "mpitrain-no-such", "-x"],
     "run: mpitrain-no-such: no such command"),
    ("cluster-run-local-not-executable", "jobs.cluster", ["run", "--local", "--", "{file}"], "not an executable"),
    ("cluster-run-no-such-file", "jobs.cluster", ["run", "--", "{missing}/cmd"], "no such command"),
    ("cluster-exec-no-such-file", "jobs.cluster", ["exec", "0", "--", "{missing}/cmd"], "no such command"),
    ("topology-expect-nodes-zero", "jobs.topology", ["--expect-nodes", "0"], "--expect-nodes"),
    ("topology-json-is-a-directory", "jobs.topology", ["--json", "{dir}"], "--json"),
    # jobs.bench.pipeline_peer's defaults (mlp, 4 layers, batch 64, 8 micro-batches, 12 steps) end in seconds.
    ("pipeline_peer-mpiexec-balance-not-summing", "jobs.bench.pipeline_peer", ["--balance", "1,2"], "--balance", "mpiexec"),
    ("pipeline_peer-balance-more-stages-than-ranks", "jobs.bench.pipeline_peer", ["--balance", "2,2"], "--balance"),
    ("pipeline_peer-mpiexec-balance-fewer-stages-than-ranks", "jobs.bench.pipeline_peer", ["--balance", "4"], "--balance",
     "mpiexec"),
    ("pipeline_peer-balance-not-numbers", "jobs.bench.pipeline_peer", ["--balance", "a,b"], "--balance"),
    ("pipeline_peer-mpiexec-microbatches-not-dividing", "jobs.bench.pipeline_peer", ["--microbatches", "3"],
     "--microbatches", "mpiexec"),
    ("pipeline_peer-mpiexec-1f1b-fewer-microbatches-than-stages", "jobs.bench.pipeline_peer", ["--microbatches", "1"],
     "--microbatches", "mpiexec"),
    ("pipeline_peer-model-not-sequential", "jobs.bench.pipeline_peer", ["--model", "resnet50"], "--model"),
    ("pipeline_peer-schedule-unknown", "jobs.bench.pipeline_peer", ["--schedule", "zb"], "--schedule"),
    ("pipeline_peer-mpiexec-json-is-a-directory", "jobs.bench.pipeline_peer", ["--json", "{dir}"], "--json", "mpiexec"),
    ("bench_pipeline-local-contender-unknown", "jobs.bench.pipeline", [*PIPE, "--contenders", "flush,gpipe"],
     "--contenders"),
    ("bench_pipeline-bandwidth-unparseable", "jobs.bench.pipeline", ["--models", "mlp", "--bandwidths", "1gbit,junk"],
     "--bandwidths", "cluster"),
    ("bench_pipeline-local-with-bandwidths", "jobs.bench.pipeline", [*PIPE, "--bandwidths", "1gbit"], "--bandwidths"),
    ("bench_pipeline-local-microbatches-not-dividing", "jobs.bench.pipeline", [*PIPE, "--microbatches", "3"],
     "--microbatches"),
    ("bench_pipeline-local-batch-not-dividing-ranks", "jobs.bench.pipeline",
     [*PIPE, "--hosts", "3", "--contenders", "flush,allreduce", "--json", "{out}/b.json"], "--batch-size"),
    ("bench_pipeline-local-1f1b-fewer-microbatches-than-hosts", "jobs.bench.pipeline",
     [*PIPE, "--hosts", "4", "--contenders", "torch-1f1b"], "--microbatches"),
    ("bench_pipeline-local-model-not-sequential", "jobs.bench.pipeline", [*PIPE, "--models", "mlp,resnet50"],
     "--models"),
    ("bench_pipeline-local-model-unknown", "jobs.bench.pipeline", [*PIPE, "--models", "alexnet"], "--models"),
    ("bench_pipeline-local-hidden-not-mlp", "jobs.bench.pipeline", [*PIPE, "--models", "vgg19", "--hidden", "64"],
     "--hidden"),
    ("bench_pipeline-local-rounds-zero", "jobs.bench.pipeline", [*PIPE, "--rounds", "0"], "--rounds"),
    ("bench_pipeline-hosts-zero", "jobs.bench.pipeline", ["--models", "mlp", "--hosts", "0"], "--hosts", "cluster"),
    ("bench_pipeline-local-plot-under-a-file", "jobs.bench.pipeline", [*PIPE, "--plot", "{file}/p.png"], "--plot"),
    ("bench_pipeline_worker-mpiexec-microbatches-not-dividing", "jobs.bench.pipeline_worker",
     ["--model", "mlp", "--batch-size", "8", "--microbatches", "3", "--rounds", "1", "--iters", "1"],
     "--microbatches", "mpiexec"),
    ("bench_pipeline_worker-model-not-sequential", "jobs.bench.pipeline_worker", ["--model", "transformer"],
     "--model"),
    ("hybcomm_choice-local-layers-out-of-range", "jobs.bench.hybcomm_choice",
     ["--local", "--model", "mlp", "--ranks", "2", "--layers", "0,2", "--json", "{out}/c.json"], "--layers"),
    ("hybcomm_choice-bandwidth-unshaped", "jobs.bench.hybcomm_choice", ["--model", "mlp", "--bandwidth", "none"],
     "--bandwidth", "cluster"),
    ("hybcomm_choice_worker-mpiexec-layers-out-of-range", "jobs.bench.hybcomm_choice_worker",
     ["--model", "mlp", "--layers", "5", "--batch-sizes", "2", "--rounds", "1", "--iters", "1"], "--layers",
     "mpiexec"),
    ("pipeline_accuracy-task-unknown", "jobs.bench.pipeline_accuracy", ["--tasks", "fc,resnet"], "--tasks"),
    ("pipeline_accuracy-mpiexec-seeds-zero", "jobs.bench.pipeline_accuracy", ["--seeds", "0"], "--seeds", "mpiexec"),
    # Good options on 2 ranks: a 4-stage pipeline needs 4.
    ("pipeline_accuracy-mpiexec-2-ranks", "jobs.bench.pipeline_accuracy",
     ["--tasks", "fc", "--seeds", "1", "--epochs", "1", "--train-samples", "512", "--json", "{out}/a.json"],
     "needs 4 ranks", "mpiexec"),
]


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
