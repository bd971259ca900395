"""Model parallelism on a process grid: layers split across ranks (tensor parallel) and stages
on consecutive ranks (pipeline). Combine either with `hpcdl.DistributedDataParallel` on the
grid's data communicator for hybrid data and model parallelism (docs/model_parallel.md)."""
from .pipeline import Pipeline
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "Pipeline", "RowParallelLinear"]
