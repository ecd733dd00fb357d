"""`python -m jobs COMMAND ...`: the `mpitrain` command without its installed script (jobs.cli)."""

import sys

from jobs.cli import main

if __name__ == "__main__":
    sys.exit(main())
