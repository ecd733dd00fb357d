"""What gpu-check runs on a GPU machine: gpu tests, MSTopK, staging overhead, profiles, 2 x 2 throughput, cross-check.

Every part is the project's own command, as a user would type it (`python -m jobs.bench.mstopk ...`), so what it
checks is what ships. Each gets a limit of at least twice its time in the earlier runs on one H100/H200 and 16
cores (benchmarks/device/), and the run a budget (--budget) that keeps all of it within 10 minutes.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys

from jobs.gpu_check.pytest_log import none_passed
from jobs.gpu_check.runner import Part

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What the throughput part runs on 2 hosts x 2 ranks (all four on this machine's GPU): every strategy of the
# runtime, torch DDP beside them, PTO once.
THROUGHPUT_STRATEGIES = "allreduce,wfbp,p3,hybcomm,topk,hier-topk,allreduce+pto,ddp"
OVERHEAD_STRATEGIES = "allreduce,wfbp,p3"
OVERHEAD_MODELS = "resnet50-224,vgg19-224"  # many small tensors; few large ones (548 MB of gradients)
THROUGHPUT_MODEL, THROUGHPUT_BATCH = "resnet50-224", 32  # its paper batch: the profile part measures it too
# The part groups, in the order they run: the least certain (root, namespaces) last.
NAMES = ("tests-serial", "tests-mpi", "mstopk", "overhead", "profiles", "throughput", "xcheck")


def mpiexec() -> str:
    """The mpiexec beside this Python (the venv's MPI), else the one on PATH (as mpicomm.launch finds it: not
    imported here, since importing mpicomm starts MPI in this driver, which must not be an MPI process itself)."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else (shutil.which("mpiexec") or "mpiexec")


def paper_batches() -> dict[str, int]:
    """runtime.workloads.paper_models.PAPER_BATCH (the models the emulated accelerators stand in for, at their
    papers' batches), read from its file: importing the package would start MPI in this driver (mpicomm)."""
    spec = importlib.util.spec_from_file_location("_paper_models",
                                                  os.path.join(ROOT, "runtime", "workloads", "paper_models.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.PAPER_BATCH)


def gpu_slug(name: str) -> str:
    """`h100` of "NVIDIA H100 80GB HBM3": the short name in a profile's file name, as earlier profiles have it."""
    for word in re.split(r"[\s/-]+", name):
        if word.upper() not in ("NVIDIA", "TESLA", "GEFORCE") and re.fullmatch(r"[A-Za-z]+\d+\w*", word):
            return word.lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def box_parts(folder: str, gpu: str, wanted=NAMES, bandwidth: str = "10gbit") -> list[Part]:
    """The parts, in the order they run, for a machine whose GPU is named `gpu`; `wanted`: the part groups to run."""
    py = sys.executable
    parts: list[Part] = []
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", "-o", "faulthandler_timeout=60"]
    if "tests-serial" in wanted:
        # Plain pytest, not under mpiexec: the job-level tests start their own 4-rank mpiexec. xdist, where
        # installed, runs 4 at once (the machine has 16 cores; each job's ranks share the GPU).
        xdist = ["-n", "4"] if importlib.util.find_spec("xdist") else []
        parts.append(Part("tests-serial", "serial gpu tests (plain pytest)", [*pytest, "-m", "gpu and not mpi",
                          *xdist], 300, "pytest", check=none_passed))
    if "tests-mpi" in wanted:
        parts.append(Part("tests-mpi", "MPI gpu tests (mpiexec -n 4)",
                          [py, os.path.join("tests", "run_mpi.py"), mpiexec(), "-prepend-rank", "-n", "4", py, "-m",
                           "mpi4py", "-m", *pytest[2:], "-m", "gpu and mpi"], 180, "pytest", check=none_passed))
    if "mstopk" in wanted:
        parts.append(Part("mstopk", "MSTopK against torch.topk at 1M, 25M, 100M elements",
                          [py, "-m", "jobs.bench.mstopk", "--device", "cuda", "--sizes", "1M,25M,100M",
                           "--json", os.path.join(folder, "mstopk.json")], 120, "mstopk", ("mstopk.json",)))
    common = [py, "-m", "jobs.bench.strategies", "--device", "cuda", "--batch-size", str(THROUGHPUT_BATCH)]
    if "overhead" in wanted:
        parts.append(Part("overhead", "staging overhead: allreduce, wfbp, p3 against the plain step, 1 rank",
                          [*common, "--local", "--hosts", "1", "--ranks-per-host", "1", "--models", OVERHEAD_MODELS,
                           "--strategies", OVERHEAD_STRATEGIES, "--rounds", "3", "--batches", "4", "--iters", "2",
                           "--warmup", "2", "--timeout", "140", "--json", os.path.join(folder, "overhead.json")],
                          150, "overhead", ("overhead.json",)))
    if "profiles" in wanted:
        # Each paper model at its paper's batch, TF32 on for cuBLAS too (cuDNN's is on by default), as the
        # profiles in benchmarks/device/2026-11-26/profiles were taken: --compute emulated:PATH replays them.
        for model, batch in paper_batches().items():
            out = os.path.join("profiles", f"{model}-b{batch}-{gpu_slug(gpu)}-tf32.json")
            parts.append(Part(f"profile-{model}", f"profile of {model}, batch {batch}",
                              [py, "-m", "jobs.simulate", "--take-profile", "--device", "cuda", "--model", model,
                               "--batch-size", str(batch), "--out", os.path.join(folder, out), "--timeout", "85"],
                              90, "profile", (out,), env={"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}))
    # The throughput part's benchmark, and the cross-check's emulated run of it: the same arguments.
    cluster = ["--batch-size", str(THROUGHPUT_BATCH), "--hosts", "2", "--ranks-per-host", "2", "--bandwidths",
               bandwidth, "--models", THROUGHPUT_MODEL, "--strategies", THROUGHPUT_STRATEGIES, "--rounds", "2",
               "--batches", "2", "--iters", "2", "--warmup", "1", "--timeout", "190"]
    if "throughput" in wanted:
        # An emulated cluster (network namespaces, shaped links): needs root, as `mpitrain cluster` does.
        parts.append(Part("throughput", f"throughput per strategy, 2 hosts x 2 ranks at {bandwidth}, "
                                        f"{THROUGHPUT_MODEL}",
                          [py, "-m", "jobs.bench.strategies", "--device", "cuda", *cluster,
                           "--json", os.path.join(folder, "throughput.json")], 200, "throughput",
                          ("throughput.json",)))
    if "xcheck" in wanted:
        # Needs the throughput part's JSON and the model's profile from this run (or an earlier one in the folder).
        profile = os.path.join(folder, "profiles", f"{THROUGHPUT_MODEL}-b{THROUGHPUT_BATCH}-{gpu_slug(gpu)}-tf32.json")
        parts.append(Part("xcheck", f"the throughput part again, compute emulated from this GPU's {THROUGHPUT_MODEL} "
                                    "profile: real against emulated",
                          [py, "-m", "jobs.gpu_check.xcheck", "--real", os.path.join(folder, "throughput.json"),
                           "--profile", profile, "--json", os.path.join(folder, "xcheck.json"), "--", *cluster],
                          200, "xcheck", ("xcheck.json",)))
    return parts
