"""Pipeline model parallelism over MPI ranks: partition, stage-to-stage transport, 1F1B schedule, weight versions."""

from .checks import DATA_PARALLEL, PipelineError
from .divergence import DIVERGE_FACTOR, DivergenceError
from .engine import Pipeline
from .model_state import load_stages
from .partition import PartitionError, as_layers, best_balance, plan_table, profile_layers
from .placement import PLACEMENTS, PipelineLayout, PlacementError
from .schedule import diagram
from .transport import PipelineShapeError
from .versions import MODES, SPECTRAIN_VARIANTS, version_difference

__all__ = [
    "DATA_PARALLEL", "DIVERGE_FACTOR", "DivergenceError", "MODES", "PLACEMENTS", "PartitionError", "Pipeline",
    "PipelineError", "PipelineLayout", "PipelineShapeError", "PlacementError", "SPECTRAIN_VARIANTS", "as_layers",
    "best_balance", "diagram", "load_stages", "plan_table", "profile_layers", "version_difference",
]
