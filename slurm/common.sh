# Shared by every slurm/*.sbatch script (sourced, not submitted): launcher, Python, environment.
# shellcheck shell=bash
set -euo pipefail

: "${SLURM_SUBMIT_DIR:?submit this script with sbatch (SLURM_SUBMIT_DIR is not set)}"
cd "$SLURM_SUBMIT_DIR"

PYTHON=${PYTHON:-$SLURM_SUBMIT_DIR/.venv/bin/python}
if [[ ! -x $PYTHON ]] && ! command -v "$PYTHON" >/dev/null; then
    echo "error: PYTHON=$PYTHON is not an executable (make setup, or set PYTHON=...)" >&2
    exit 2
fi
# As if the venv were activated: its mpiexec (the one its mpi4py was built for) and mpitrain come first.
if [[ $PYTHON == */* ]]; then
    PATH="$(dirname "$PYTHON"):$PATH"
fi
# The launcher (word-split on purpose: LAUNCHER may carry options). By default, the pip mpich wheel's own
# hydra mpiexec where PYTHON has one beside it: hydra starts one proxy per node with srun and serves the
# ranks' PMI itself. Under srun --mpi=pmi2 that MPICH fails in MPI_Init ("mpi/pmi2: invalid client
# request", then a UCX address assertion) once its UCX address outgrows one PMI-2 value, as it does on
# nodes with many network interfaces (12 here; a GPU node's HCAs, bonds and bridges). An MPI built
# against SLURM's PMI (a site's) keeps srun.
if [[ -z ${LAUNCHER:-} ]]; then
    LAUNCHER="srun --mpi=pmi2 --kill-on-bad-exit=1"
    hydra=$(dirname "$PYTHON")/mpiexec
    # Its output captured, not piped to grep -q: under pipefail an early grep exit would fail the test.
    if [[ $PYTHON == */* && -x $hydra && $("$hydra" --version 2>/dev/null) == *HYDRA* ]]; then
        LAUNCHER=$hydra
    fi
fi
read -ra launcher <<< "$LAUNCHER"
# The jobs' command, installed beside PYTHON (make setup, or pip install mpitrain); absolute for srun.
if ! MPITRAIN=$(command -v mpitrain); then
    echo "error: no mpitrain command beside PYTHON=$PYTHON or on PATH (make setup, or pip install the package)" >&2
    exit 2
fi
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
# Parallel file systems (Lustre, GPFS, NFS) often refuse HDF5's file locks.
export HDF5_USE_FILE_LOCKING=FALSE

echo "# job ${SLURM_JOB_ID:-?} (${SLURM_JOB_NAME:-?}): ${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NUM_NODES:-?} node(s)" \
     "${SLURM_JOB_NODELIST:-?}, launcher: ${launcher[*]}"
