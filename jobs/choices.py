"""runtime's model and strategy names, for checking a command line without importing runtime (which starts MPI)."""

# tests/test_job_inputs.py checks these against runtime.models.MODELS and runtime's strategy tables.
MODELS = ("mlp", "vgg19", "resnet50", "transformer")
EXACT_STRATEGIES = ("allreduce", "wfbp", "p3")
SPARSE_STRATEGIES = ("topk", "hier-topk")
STRATEGIES = EXACT_STRATEGIES + SPARSE_STRATEGIES
