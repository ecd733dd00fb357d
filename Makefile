# mpitrain: `make demo` and `make test` each do their own set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
MPITRAIN := $(VENV)/bin/mpitrain
NP ?= 4
# Outer limits so that no MPI run can hang the build, whatever happens inside it.
MPI_TIMEOUT ?= 900
# A hang shows where every rank waits: each dumps its threads' stacks after 45 s in one test (none
# takes 10 s), before pytest-timeout ends the first rank and with it the job.
PYTEST_MPI := $(PY) -m mpi4py -m pytest -m mpi -p no:cacheprovider -q -o faulthandler_timeout=45
# Those dumps scroll far above a log's tail: on failure run_mpi.py repeats them, per rank, at the end.
RUN_MPI := $(PY) tests/run_mpi.py timeout $(MPI_TIMEOUT) $(MPIEXEC) -prepend-rank
FAKE_HOSTS := -hosts n1:2,n2:2 -launcher ssh -launcher-exec mpicomm/launcher/fake-ssh
STAMP := $(VENV)/.mpitrain-setup

.PHONY: setup setup-system setup-corpus bytecode demo test test-serial test-mpi test-mpi-hosts test-mpi-emulated test-cluster test-slurm \
	bench-collectives gpu-check clean

setup: setup-system $(STAMP) setup-corpus bytecode

# The project's own modules compiled once, for the hundreds of processes the tests start (~0.17 CPU-s each to
# compile its ~100 modules otherwise): where PYTHONDONTWRITEBYTECODE is set, no process writes them itself.
# Python still checks each file's source against its .pyc, so an edit never runs stale code. Quick when current.
bytecode: $(STAMP)
	@PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -q jobs runtime mpicomm datacache tests >/dev/null

# Debian packages, only when root (CI is root): Fashion-MNIST for the demo, and what the
# emulated-cluster and SLURM tests need (without root those tests skip with a reason).
# Cheap when already installed.
FASHION := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
setup-system:
	@if [ "$$(id -u)" = 0 ] && ! { command -v sbatch && command -v munged && command -v tc && command -v unshare \
	      && test -f $(FASHION); } >/dev/null; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge iproute2 util-linux \
	    dataset-fashion-mnist; fi
	@test -f $(FASHION) || echo "note: Fashion-MNIST missing (as root: apt-get install dataset-fashion-mnist); the demo needs it"
	@if [ "$$(id -u)" = 0 ] && [ ! -s /etc/munge/munge.key ]; then mungekey --create && chown munge:munge /etc/munge/munge.key; fi

# The Jane Austen corpus of the char-LSTM (r-cran-janeaustenr, into ~/.cache/mpitrain or
# $MPITRAIN_DATA_DIR): apt-get download needs apt lists, not root; when root and the lists lack
# it, one apt-get update and a second try. Run as a file, not a module, so that no torch is
# imported: well under a second when the corpus is already there.
setup-corpus: $(STAMP)
	@$(PY) -P datacache/austen.py >/dev/null 2>&1 \
	  || { [ "$$(id -u)" = 0 ] && apt-get update -q >/dev/null; $(PY) -P datacache/austen.py >/dev/null; } \
	  || echo "note: the Jane Austen corpus is missing (see the error above); tests/test_austen.py needs it"

# torch first and pinned: this version is served as a local CPU build, any other spec pulls a
# multi-GB CUDA build. Re-runs only when the package metadata changes.
$(STAMP): setup.cfg pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c "import mpi4py, torch, h5py; from mpi4py import MPI; print('set-up ok:', MPI.Get_library_version().splitlines()[0], '| torch', torch.__version__)"
	touch $@

# The main job on its defaults: MLP on Fashion-MNIST, 4 ranks, p3, 2 epochs.
demo: setup
	mkdir -p results
	timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $(NP) $(MPITRAIN) train --json results/train.json --timeline results/train-trace.json

test: setup test-serial test-mpi test-mpi-hosts test-mpi-emulated
	@echo "make test: all parts passed"

# The serial part runs every job end to end (many 4-rank jobs): a longer outer limit, same role. It took
# 983-1119 s (1930 s on a slow day) on a 2-vCPU VM whose processes spend ~2.5 s each importing torch and
# torch._dynamo (the first optimizer): the limit is for a hang (each test has its own), not a speed target.
SERIAL_TIMEOUT ?= 3600
test-serial: setup
	timeout $(SERIAL_TIMEOUT) $(PY) -m pytest -m "not mpi" -p no:cacheprovider -q --durations=30

# One rank's failure aborts the whole job (python -m mpi4py), pytest-timeout bounds each test.
test-mpi: setup
	$(RUN_MPI) -n $(NP) $(PYTEST_MPI)

# The same suite on 2 fake hosts x 2 ranks (hydra launcher wrapper): real node/cross groups.
test-mpi-hosts: setup
	MPITRAIN_EXPECT_NODES=2 $(RUN_MPI) $(FAKE_HOSTS) -n 4 $(PYTEST_MPI)

# And with 2 nodes x 2 ranks emulated by the ranks_per_node override. The override only changes how
# Topology finds the nodes (the communicators are those of the part above, which runs every file on two
# nodes), so this part runs the override's own tests and the strategies end to end under it, not the
# layout-dependent files a third time (~90 s of CI on 2 cores).
NODE_TESTS := $(addprefix tests/,test_topology_mpi.py test_transparency_mpi.py)
test-mpi-emulated: setup
	MPITRAIN_RANKS_PER_NODE=2 MPITRAIN_EXPECT_NODES=2 $(RUN_MPI) -n 4 $(PYTEST_MPI) $(NODE_TESTS)

# Parts of test-serial, on their own (root): namespaces and shaped links; a real local SLURM.
test-cluster: setup
	timeout $(MPI_TIMEOUT) $(PY) -m pytest -m cluster -p no:cacheprovider -q

test-slurm: setup
	timeout $(MPI_TIMEOUT) $(PY) -m pytest -m slurm -p no:cacheprovider -q

bench-collectives: setup
	mkdir -p results
	timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $(NP) $(MPITRAIN) bench collectives --json results/collectives.json

# Everything GPU in one run (jobs.gpu_check): the gpu tests (serial ones with plain pytest, MPI ones under
# mpiexec -n 4), MSTopK, the staging overhead, the profiles, 2 x 2 throughput and its emulated cross-check; one
# report, exit 1 if a part failed, 2 without a GPU. No set-up (a GPU machine may have no package registry, and
# `setup` installs a CPU torch): the python on PATH, an activated venv's or the machine's own with its CUDA
# torch (the device box's run.sh puts its venv first on PATH), with this checkout on PYTHONPATH.
# GPU_CHECK_DIR=DIR: the report's folder (default gpu-check-DATE-TIME); GPU_CHECK_ARGS: more options (--parts,
# --budget: mpitrain gpu-check --help).
GPU_PYTHON ?= $(shell command -v python 2>/dev/null || command -v python3)
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m jobs.gpu_check.main \
	  $(if $(GPU_CHECK_DIR),--out $(GPU_CHECK_DIR)) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) results *.egg-info
