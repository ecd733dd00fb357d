"""Parts of jobs.train: its data, the pipeline-parallel branch (`--parallel pipeline`) and data-parallel `--resume`."""
