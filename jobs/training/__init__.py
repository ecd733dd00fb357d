"""Parts of jobs.train: the pipeline-parallel branch (`--parallel pipeline`)."""
