"""`make gpu-check` (`mpitrain gpu-check`): every GPU test and GPU benchmark in one run, one report."""
