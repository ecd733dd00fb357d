"""runtime's model and strategy names, for checking a command line without importing runtime (which starts MPI)."""

# tests/test_job_inputs.py checks these against runtime.models.MODELS and runtime's strategy tables,
# tests/test_sequential_models.py TOKEN_MODELS against runtime.models.TOKEN_MODELS.
MODELS = ("mlp", "vgg19", "resnet50", "transformer", "fc-heavy", "char-lstm", "vgg19-22k")
# Those that take token sequences, not images (runtime.models.TOKEN_MODELS).
TOKEN_MODELS = ("transformer", "char-lstm")
EXACT_STRATEGIES = ("allreduce", "wfbp", "p3")
SPARSE_STRATEGIES = ("topk", "hier-topk")
STRATEGIES = EXACT_STRATEGIES + SPARSE_STRATEGIES
# runtime.pipeline.MODES, and the models whose forward is a chain a pipeline can cut (pipeline_layers()).
PIPELINE_MODES = ("flush", "vanilla", "stash", "spectrain")
SEQUENTIAL_MODELS = ("mlp", "vgg19", "fc-heavy", "char-lstm")
