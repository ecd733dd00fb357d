"""Parts of jobs.train: the pipeline-parallel branch (`--parallel pipeline`) and data-parallel `--resume`."""
