# Shared by every slurm/*.sbatch script (sourced, not submitted): launcher, Python, environment.
# shellcheck shell=bash
set -euo pipefail

: "${SLURM_SUBMIT_DIR:?submit this script with sbatch (SLURM_SUBMIT_DIR is not set)}"
cd "$SLURM_SUBMIT_DIR"

# Word-split on purpose: LAUNCHER may carry options. mpiexec runs from the venv (see PATH below).
read -ra launcher <<< "${LAUNCHER:-srun --mpi=pmi2 --kill-on-bad-exit=1}"
PYTHON=${PYTHON:-$SLURM_SUBMIT_DIR/.venv/bin/python}
if [[ ! -x $PYTHON ]] && ! command -v "$PYTHON" >/dev/null; then
    echo "error: PYTHON=$PYTHON is not an executable (make setup, or set PYTHON=...)" >&2
    exit 2
fi
# As if the venv were activated: its mpiexec (the one its mpi4py was built for) and mpitrain come first.
if [[ $PYTHON == */* ]]; then
    PATH="$(dirname "$PYTHON"):$PATH"
fi
# The jobs' command, installed beside PYTHON (make setup, or pip install mpitrain); absolute for srun.
if ! MPITRAIN=$(command -v mpitrain); then
    echo "error: no mpitrain command beside PYTHON=$PYTHON or on PATH (make setup, or pip install the package)" >&2
    exit 2
fi
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
# Parallel file systems (Lustre, GPFS, NFS) often refuse HDF5's file locks.
export HDF5_USE_FILE_LOCKING=FALSE

echo "# job ${SLURM_JOB_ID:-?} ($SLURM_JOB_NAME): ${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NUM_NODES:-?} node(s)" \
     "${SLURM_JOB_NODELIST:-?}, launcher: ${launcher[*]}"
