"""The benchmarks, one module each and its MPI worker beside it: `mpitrain bench NAME`, `python -m jobs.bench.NAME`."""
