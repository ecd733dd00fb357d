"""jobs: runnable entry points (`python -m jobs.<name>`); importing them does no MPI work."""
