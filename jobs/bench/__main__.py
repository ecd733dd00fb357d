"""`python -m jobs.bench`: the strategy benchmark (jobs.bench.strategies), as before the benchmarks had a room."""

import sys

from jobs.bench.strategies import main

if __name__ == "__main__":
    sys.exit(main())
