"""runtime: the training runtime (data-parallel strategies, pipeline) built on mpicomm."""
