"""`python -m jobs.bench`: the strategy benchmark (jobs.bench.strategies), as before the benchmarks had a room."""

from jobs.bench.strategies import main

if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
