"""The wheel, as a cluster user installs it: every sub-package inside, no build warning, and the jobs running
from a fresh environment that sees the test environment's dependencies but not this source tree."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from readme_blocks import readme_program

from conftest import ROOT
from mpicomm.launch import mpiexec

PACKAGES = ("mpicomm", "runtime", "datacache", "jobs")


def source_packages() -> set[str]:
    """Every directory of the four packages that holds Python modules, as a dotted name."""
    found = set()
    for top in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if any(f.endswith(".py") for f in files):
                found.add(os.path.relpath(folder, ROOT).replace(os.sep, "."))
    return found


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, build output, venv python, venv bin): built from a copy of the tree, installed with --no-deps."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in PACKAGES:  # a copy: an in-tree build would leave build/ and *.egg-info behind
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
                            "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheel = next((tmp / "dist").glob("mpitrain-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # The test environment's packages (torch, mpi4py, mpich, ...), after the venv's own: plain path lines,
    # so the editable install's finder there (a .pth of its own) is not run and the source tree stays unseen.
    deps = [p for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]] if os.path.isdir(p)]
    with open(os.path.join(purelib, "test-environment.pth"), "w") as f:
        f.write("\n".join(dict.fromkeys(deps)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
                    "--disable-pip-version-check", "-q", str(wheel)], check=True, timeout=300)
    run_dir = tmp / "elsewhere"
    run_dir.mkdir()
    return wheel, build.stdout + build.stderr, python, str(venv / "bin"), str(run_dir)


def run(cmd, cwd, timeout=180):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # mpi4py looks for the mpich wheel's libmpi under its own environment's prefix; here that is the test's.
    if any(name.startswith("libmpi") for name in os.listdir(os.path.join(sys.prefix, "lib"))):
        env.setdefault("MPI4PY_LIBMPI", os.path.join(sys.prefix, "lib"))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def test_wheel_holds_every_package_and_builds_without_warnings(installed):
    wheel, output, *_ = installed
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {os.path.dirname(n).replace("/", ".") for n in names if n.endswith(".py")}
    assert source_packages() <= in_wheel, f"missing from the wheel: {sorted(source_packages() - in_wheel)}"
    for script in ("fake-ssh", "netns-ssh"):
        info = zipfile.ZipFile(wheel).getinfo(f"mpicomm/launcher/{script}")
        assert info.external_attr >> 16 & 0o111, f"{script} is not executable in the wheel"
    assert "mpitrain = jobs.cli:main" in zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("entry_points.txt"))).decode()
    warnings = [line for line in output.splitlines() if "warn" in line.lower()]
    assert not warnings, "\n".join(warnings)


def test_installed_package_is_the_wheel_not_the_tree(installed):
    _, _, python, _, cwd = installed
    proc = run([python, "-c", "import json, jobs, runtime, runtime.sim, mpicomm.emulation, datacache, "
                "runtime.workloads.models; print(json.dumps([m.__file__ for m in (jobs, runtime, datacache)]))"], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = json.loads(proc.stdout)
    venv = os.path.dirname(os.path.dirname(python))
    assert all(f.startswith(venv) for f in files), files


def test_readme_program_runs_from_the_wheel(installed):
    _, _, python, _, cwd = installed
    script = os.path.join(cwd, "example.py")
    with open(script, "w") as f:
        f.write(readme_program())
    proc = run(["timeout", "-k", "5", "240", mpiexec(), "-n", "2", python, script], cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("test accuracy") == 3, proc.stdout


def test_command_and_a_job_from_the_wheel(installed):
    _, _, python, bin_dir, cwd = installed
    mpitrain = os.path.join(bin_dir, "mpitrain")
    listing = run([mpitrain, "--help"], cwd)
    assert listing.returncode == 0 and "bench pipeline" in listing.stdout, listing.stderr
    for cmd in ([python, "-m", "jobs.train", "--help"], [mpitrain, "train", "--help"]):
        proc = run(cmd, cwd)
        assert proc.returncode == 0 and "--strategy" in proc.stdout, proc.stderr[-2000:]
    out = os.path.join(cwd, "train.json")
    proc = run(["timeout", "-k", "5", "240", mpiexec(), "-n", "2", mpitrain, "train", "--model", "mlp", "--data",
                "synthetic", "--synthetic-samples", "512", "--batch-size", "32", "--epochs", "1", "--no-progress",
                "--json", out], cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        doc = json.load(f)
    assert doc["ranks"] == 2 and [r["epoch"] for r in doc["epochs"]] == [1], doc
    # The installed launcher wrapper makes two fake hosts, as the Makefile's does from the tree.
    fake_ssh = run([python, "-c", "import mpicomm, os; print(os.path.join(os.path.dirname(mpicomm.__file__), "
                    "'launcher', 'fake-ssh'))"], cwd).stdout.strip()
    proc = run(["timeout", "-k", "5", "120", mpiexec(), "-hosts", "n1:1,n2:1", "-launcher", "ssh", "-launcher-exec",
                fake_ssh, "-n", "2", mpitrain, "topology", "--expect-nodes", "2"], cwd, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
