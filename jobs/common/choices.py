"""runtime's model and strategy names, for checking a command line without importing runtime (which starts MPI)."""

# tests/test_job_inputs.py checks these against runtime.workloads.models and runtime's strategy and option tables,
# tests/test_sequential_models.py TOKEN_MODELS against runtime.workloads.models.TOKEN_MODELS.
MODELS = ("mlp", "vgg19", "resnet50", "transformer", "fc-heavy", "char-lstm", "vgg19-22k", "cnn",
          "vgg19-224", "vgg19-22k-224", "resnet50-224", "transformer-big")
# Those that take token sequences, not images (runtime.workloads.models.TOKEN_MODELS).
TOKEN_MODELS = ("transformer", "char-lstm", "transformer-big")
EXACT_STRATEGIES = ("allreduce", "wfbp", "p3", "hybcomm")
SPARSE_STRATEGIES = ("topk", "hier-topk")
STRATEGIES = EXACT_STRATEGIES + SPARSE_STRATEGIES
# hybcomm's options (runtime.options.HYBCOMM_DENSE, HYBCOMM_FORCE).
HYBCOMM_DENSE = ("wfbp", "p3")
HYBCOMM_FORCE = ("auto", "sfb", "ps")
# p3's credit in words (runtime.options.AUTO, ONLINE); else a count.
P3_CREDIT_WORDS = ("auto", "online")
# Models whose head has its own number of classes whatever the data (runtime.workloads.models.FIXED_CLASSES).
FIXED_CLASSES = {"vgg19-22k": 21_841, "vgg19-224": 1000, "vgg19-22k-224": 21_841, "resnet50-224": 1000}
# runtime.pipeline.MODES, and the models whose forward is a chain a pipeline can cut (pipeline_layers()).
PIPELINE_MODES = ("flush", "vanilla", "stash", "spectrain")
SEQUENTIAL_MODELS = ("mlp", "cnn", "vgg19", "fc-heavy", "char-lstm")
